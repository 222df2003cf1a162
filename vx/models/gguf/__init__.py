"""GGUF files as vx reads them: the header (`header`, torch-free: the application process checks a file with it), the
config directory written from the metadata (`config`, with DeepSeek-V2's own in `deepseek2`) and the tensors under
Hugging Face names (`weights`, in the engine). Each architecture's quirks come from its row in vx.models.registry.

The package imports nothing itself, so importing the header pulls in neither torch nor transformers.
"""
