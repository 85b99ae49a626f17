"""`lodger serve`: an OpenAI-compatible HTTP server for a base model and the adapters of runs,
with adapter hot-reload and an inference lease that makes background training yield."""
