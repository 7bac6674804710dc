"""The cost model: what a training step does, what it costs and whether it fits, read before a launch.

archs and arch_configs (the published architectures as data, built on the meta device), cost (FLOPs counted there,
the hardware table, η and prices), activations and memory (the memory model with counted activations), plan
(`flowrl plan CONFIG`: a config's own step on a stand-in, priced and sized at real size) and projection (the race's
toy runs priced at SD3.5-Medium's size). docs/cost.md explains the model.
"""
