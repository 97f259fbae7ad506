"""The OpenAI-compatible front: ``/v1/chat/completions`` with images, served by a FastAPI
app under uvicorn beside the Triton server that hosts ``epd`` (or ``aggregated``), whose
public models it calls over gRPC.

Request and response types are vLLM's own OpenAI protocol models, so the front accepts
what ``vllm serve`` accepts and answers in the same shapes (``docs/design.md`` says why
these and not the ``openai`` package's types).
"""
