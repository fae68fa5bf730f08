"""`roll serve`: an OpenAI-compatible HTTP server over a Hugging Face model or a run's checkpoint.

``model_path`` finds the weights and the tokenizer of what is served, ``engine`` batches concurrent requests
onto the generation strategy that actor_infer uses, ``app`` is the HTTP API, and ``commands`` the `roll serve`
and `roll model build-tiny-judge` subcommands. Importing this package loads none of them.
"""
