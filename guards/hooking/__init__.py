"""How kvguard reaches vLLM's code: the installed source read, its asserts found and
rewritten into metered checks, the import hook and the instrumentor that installs them."""
