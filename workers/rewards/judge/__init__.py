"""The judge scorer's plumbing: an OpenAI-compatible chat client with retries (``client``) and concurrency and
rate limits shared by the scoring processes of a machine (``limits``)."""
