"""The judge scorer's plumbing: an OpenAI-compatible chat client with retries (``client``), concurrency and
rate limits shared by the scoring processes of a machine (``limits``), the local judge actor (``local``), and the
failures that mask a sample (``errors``)."""
