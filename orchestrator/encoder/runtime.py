"""Inference runtimes for the exported vision encoder (see ``onnx_export``).

One small interface, two backends: ONNX Runtime, which the ``vision_encoder`` model runs
on CPU, and TensorRT, with which ``epd encoder build --trt`` builds a GPU host's plan and
checks it against ONNX Runtime (Triton then serves the plan itself). Both run an ONNX file
of the same graph and read the encoder identity from its metadata, so cache keys do not
depend on the backend. Inputs are whatever the model family's graph takes, by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from orchestrator.encoder.onnx_export import (
    META_ENCODER_ID,
    META_HIDDEN_SIZE,
    OUTPUT_NAME,
    read_metadata,
)


class VisionEncoderRuntime(ABC):
    """Turns one image's graph inputs into the embeddings vLLM accepts as ``image_embeds``."""

    encoder_id: str
    """Identity of the weights (from the ONNX metadata); part of embedding cache keys."""
    hidden_size: int
    input_names: tuple[str, ...]

    @abstractmethod
    def run(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """Embeddings ``[tokens, hidden_size]`` float32 from the graph's inputs by name."""

    def _set_identity(self, meta: dict[str, str]) -> None:
        try:
            self.encoder_id = meta[META_ENCODER_ID]
            self.hidden_size = int(meta[META_HIDDEN_SIZE])
        except KeyError as e:
            raise ValueError(
                f"ONNX file lacks {e.args[0]!r} metadata: not made by export_vision_encoder "
                "(or made by an older version: export it again)"
            ) from e

    def _check(self, feeds: dict[str, np.ndarray]) -> None:
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise ValueError(f"vision encoder inputs missing: {missing}")


class OnnxRuntimeEncoder(VisionEncoderRuntime):
    """CPU inference with onnxruntime."""

    def __init__(
        self, onnx_path: str | Path, intra_op_threads: int = 0, allow_spinning: bool = False
    ) -> None:
        """``intra_op_threads=0`` lets onnxruntime use all cores; set it when several
        encoder instances share a host so they do not oversubscribe it. Spinning threads
        shave latency on dedicated cores but steal CPU from co-located vLLM engines, so it is
        off unless asked for."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if allow_spinning else "0"
        )
        self._session = ort.InferenceSession(
            str(onnx_path), options, providers=["CPUExecutionProvider"]
        )
        self._set_identity(self._session.get_modelmeta().custom_metadata_map)
        self.input_names = tuple(i.name for i in self._session.get_inputs())

    def run(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        self._check(feeds)
        return self._session.run([OUTPUT_NAME], {n: feeds[n] for n in self.input_names})[0]


class TensorRTUnavailable(RuntimeError):
    """This machine cannot build or run TensorRT engines (no ``tensorrt`` or no CUDA)."""


def require_tensorrt():
    """``(tensorrt, torch)`` on a GPU host; ``TensorRTUnavailable`` saying why not elsewhere."""
    try:
        import tensorrt as trt
    except ImportError:
        raise TensorRTUnavailable(
            "TensorRT is not installed: the TensorRT encoder is built and run on GPU hosts "
            "(pip install tensorrt there, or use the GPU image in docker/)"
        ) from None
    import torch

    if not torch.cuda.is_available():
        raise TensorRTUnavailable("TensorRT needs a CUDA device and none is visible")
    return trt, torch


class TensorRTEncoder(VisionEncoderRuntime):
    """GPU inference with TensorRT (10.x Python API), engine built from an ONNX file exported
    for ``target="tensorrt"`` (plain attention ops, which TensorRT fuses).

    Untested: this code has never run. It was written for GPU hosts; the development and CI
    machines have no GPU and cannot install ``tensorrt``, so ``tensorrt`` and ``torch.cuda``
    (used for device buffers and the stream) are imported only when an instance is made.
    The engine has one optimization profile over every dynamic axis (``min/opt/max`` rows);
    a serialized engine is cached at ``engine_path``.
    """

    def __init__(
        self,
        onnx_path: str | Path,
        engine_path: str | Path | None = None,
        min_rows: int = 4,
        opt_rows: int = 1024,
        max_rows: int = 16384,
        fp16: bool = False,
        workspace_bytes: int = 2 << 30,
    ) -> None:
        trt, torch = require_tensorrt()
        self._trt, self._torch = trt, torch
        onnx_path = Path(onnx_path)
        self._set_identity(read_metadata(onnx_path))
        self._logger = trt.Logger(trt.Logger.WARNING)
        engine_path = Path(engine_path) if engine_path else onnx_path.with_suffix(".plan")
        if engine_path.exists():
            serialized = engine_path.read_bytes()
        else:
            serialized = self._build(onnx_path, min_rows, opt_rows, max_rows, fp16, workspace_bytes)
            engine_path.write_bytes(serialized)
        self._engine = trt.Runtime(self._logger).deserialize_cuda_engine(serialized)
        if self._engine is None:
            raise RuntimeError(f"cannot deserialize TensorRT engine {engine_path}")
        self._context = self._engine.create_execution_context()
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        self.input_names = tuple(
            n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT
        )

    def _build(
        self, onnx_path: Path, lo: int, opt: int, hi: int, fp16: bool, workspace_bytes: int
    ) -> bytes:
        trt = self._trt
        builder = trt.Builder(self._logger)
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, self._logger)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise RuntimeError(f"TensorRT cannot parse {onnx_path}: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
        if fp16:
            config.set_flag(trt.BuilderFlag.FP16)
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            shape = tuple(tensor.shape)

            def at(rows: int, shape=shape) -> tuple[int, ...]:
                return tuple(rows if d == -1 else d for d in shape)

            profile.set_shape(tensor.name, at(lo), at(opt), at(hi))
        config.add_optimization_profile(profile)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise RuntimeError(f"TensorRT engine build failed for {onnx_path}")
        return bytes(serialized)

    def run(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        self._check(feeds)
        trt, torch = self._trt, self._torch
        keep = []
        for name in self.input_names:
            dtype = trt.nptype(self._engine.get_tensor_dtype(name))
            device = torch.from_numpy(np.ascontiguousarray(feeds[name], dtype=dtype)).cuda()
            self._context.set_input_shape(name, tuple(device.shape))
            self._context.set_tensor_address(name, device.data_ptr())
            keep.append(device)
        shape = tuple(self._context.get_tensor_shape(OUTPUT_NAME))
        out = torch.empty(shape, dtype=torch.float32, device="cuda")
        self._context.set_tensor_address(OUTPUT_NAME, out.data_ptr())
        stream = torch.cuda.current_stream()
        if not self._context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        stream.synchronize()
        return out.cpu().numpy()
