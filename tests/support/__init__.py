"""Plain helpers shared by the tests (fixtures stay in the conftest.py files):

- `tiny_models`: tiny random Hugging Face models of every supported family, saved as safetensors;
- `tiny_tokenizer`: a tiny deterministic byte-level BPE tokenizer with a ChatML template;
- `paged_attention`: `CommonAttentionMetadata` for a batch, and `PagedRunner`, which drives a model step by step
  through a paged KV cache;
- `attention_cases`: random attention steps on shuffled block tables (float or quantized caches), to compare one
  backend with another, and a quantized cache with the float one;
- `triton_probes`: tiny Triton kernels exposing one device function of vx's kernels (imports triton: interpreter
  worker only);
- `engine_processes`: engine arguments for the tiny models, and checks on the processes a test leaves behind;
- `server`: a `vx serve` subprocess, and raw HTTP/1.1 over a socket;
- `worker_view`: the workers' side of the step contract, for the scheduler tests;
- `faulty_executors`: executors that raise inside `execute_model` (after N steps, or once a file exists), which an
  engine uses when `distributed_executor_backend` names one;
- `quant_matmul`: random weight-only quantized layers, their float64 weight, and the rounding bound a quantized
  matmul must meet against it.
- `quantized_checkpoints`: AWQ, GPTQ and FP8 checkpoints packed from a tiny model's float weights, each beside its
  float twin with the dequantized weights;
- `vx_outputs`: a model directory loaded as the engine resolves it, its prefill logits, its greedy tokens through
  `vx.LLM`, and the bytes its linear layers' weights take;
- `registry_scan`: the collection literals of vx's source that list a registry's names outside the registry;
- `decode_graphs`: engines with decode graphs: their prompts, Hugging Face's greedy tokens for them, vx's in this
  process or in an engine process of its own.
"""
