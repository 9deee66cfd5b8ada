"""The hf engine on CUDA: a decode step with static shapes per batch bucket, captured as CUDA graphs; decode
attention over each slot's own length (a Triton split-K kernel); the one draw (sampling/draw.py) runs on the device
as it is. Written and tested on CPU (the Triton kernels under TRITON_INTERPRET=1, the step's graph safety with a
host-sync guard); the `gpu` tests run them on CUDA."""
