"""Inference shared by actor_infer, `roll serve` and the local judge: the request batcher that joins concurrent
requests into batches (``request_batcher``), the generation engine over ``HFInferStrategy`` that `roll serve` and
the judge actor run (``engine``), and where a model folder or a run's checkpoint keeps its weights and tokenizer
(``model_path``)."""
