"""Running a rank: what the engine calls on its runner (interface.py), the
rank worker that sets up a device and drives it, the model runner (one flat
forward per step) with its staging buffer and CUDA graphs, and the
simulated runner that stands in with a cost model's step time."""
