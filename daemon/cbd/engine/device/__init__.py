"""The step on the device: inputs packed and staged, the forward and sampling launched on CUDA streams
(no-ops on CPU), CUDA graphs, and the tensor-parallel workers. Knows no requests or sessions: it receives
a booked plan and returns tokens."""
