"""Every `flowrl bench ...` measurement, one module each: trainers (the race of the recipes to GRPO's held-out
accuracy), balancers, candidates, rollout, tree, rewards (with serving: the reward service on Ray Serve), report,
train; cli (the `flowrl bench` arguments). The held-out grade they share is flowrl.heldout; the price of their work at
real size is flowrl.plan."""
