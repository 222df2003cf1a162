"""vx's own C kernels for the CPU and the machinery that builds them on first use (`build.py`).

Both the model layers (`vx.models`) and the workers (`vx.gpu`) use them, so this package imports neither: only
torch, the leaf modules (`vx.envs`, `vx.platform`) and the standard library. The C sources live in `csrc/`
(the attention kernel's beside its backend, in `vx/gpu/attention/csrc/`).
"""
