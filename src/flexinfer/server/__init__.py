"""`flexinfer serve`: an OpenAI-compatible HTTP server over an LLM (docs/server.md).

The package's modules import FastAPI; `main` does so only when serving, so
that the `flexinfer` command can register `serve` without loading it."""
