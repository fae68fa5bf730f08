"""`roll serve`: an OpenAI-compatible HTTP server over a Hugging Face model or a run's checkpoint.

``app`` is the HTTP API and ``commands`` the `roll serve` and `roll model build-tiny-judge` subcommands; what
they serve with lives in the inference layer the local judge shares (workers/inference: ``model_path`` finds the
weights and the tokenizer, ``engine`` batches concurrent requests onto the generation strategy that actor_infer
uses). Importing this package loads none of them.
"""
