"""The OpenAI-compatible front: ``/v1/chat/completions`` with images, ``/v1/completions``,
``/tokenize`` and ``/detokenize``, served by a FastAPI app under uvicorn beside the Triton
server that hosts ``epd`` (or ``aggregated``): ``epd``'s pipeline runs in the front itself,
``aggregated`` is called over gRPC.

``app`` (routes) reads a request with ``chat`` / ``completions`` into a job that
``serving`` answers with what ``service`` holds (pipeline, client, limits, counters);
``request`` and ``answer`` are what both endpoints share, ``tokens`` the tokenizer routes.
Request and response types are vLLM's own OpenAI protocol models, so the front accepts
what ``vllm serve`` accepts and answers in the same shapes (``docs/design.md`` says why
these and not the ``openai`` package's types).
"""
