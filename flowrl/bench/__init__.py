"""Every `flowrl bench ...` measurement, one module each: trainers (the race of the recipes to GRPO's held-out
accuracy), balancers, candidates, rollout, tree, speed (rewards, report, train); accuracy (the Shapes world's exact
grade that the race, the balancer bench and the demo share); cli (the `flowrl bench` arguments)."""
