"""The components every recipe calls, as torchtune's `training/`: prompts (the grouped prompt sampler), scoring
(rewards and the error policy, gather, balance), optim (the optimizer step for DP / FSDP2 / ZeRO-2, loss scaling,
EMA), runs (the run folder), loop (the run loop, clocks, step metrics), checkpoint (atomic save and resume),
evaluation (split over the ranks), distributed."""
