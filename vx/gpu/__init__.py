"""The workers' side: Worker, ModelRunner, batch, sampling, attention, graphs (on CUDA or CPU: the name is the
role). The package imports nothing itself, so the application process reads `attention.registry` without torch."""
