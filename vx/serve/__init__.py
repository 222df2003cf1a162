"""`vx serve`: an OpenAI-compatible HTTP server around one `vx.AsyncLLM` (FastAPI + uvicorn).

`vx.serve.app.build_app` builds the app; `vx serve` (vx/cli.py) runs it. See docs/serve.md.
"""
