"""Inference runtimes for the exported vision encoder (see ``onnx_export``).

The encoder stage talks to one small interface so the backend (onnxruntime on CPU here,
TensorRT on a GPU host) is a deployment choice. Both run the same ONNX file and read the
encoder identity from its metadata, so cache keys do not depend on the backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Literal

import numpy as np

from orchestrator.encoder.onnx_export import (
    INPUT_NAMES,
    META_ENCODER_ID,
    META_HIDDEN_SIZE,
    META_MERGE_SIZE,
    OUTPUT_NAME,
)
from orchestrator.encoder.preprocess import segment_ids, vision_position_ids


def graph_inputs(
    pixel_values: np.ndarray, image_grid_thw: np.ndarray | tuple[int, int, int], merge_size: int
) -> dict[str, np.ndarray]:
    """The encoder graph's inputs by name: patches plus the positions and segments numpy
    computes from the grid (the part of the vision forward a static graph cannot hold)."""
    return dict(
        zip(
            INPUT_NAMES,
            (
                pixel_values,
                vision_position_ids(image_grid_thw, merge_size),
                segment_ids(image_grid_thw),
            ),
            strict=True,
        )
    )


class VisionEncoderRuntime(ABC):
    """Turns preprocessed patches into the embeddings vLLM accepts as ``image_embeds``."""

    encoder_id: str
    """Identity of the weights (from the ONNX metadata); part of embedding cache keys."""
    merge_size: int
    hidden_size: int

    def encode(
        self, pixel_values: np.ndarray, image_grid_thw: np.ndarray | tuple[int, int, int]
    ) -> np.ndarray:
        """Embeddings ``[sum(t*h*w) / merge_size**2, hidden_size]`` float32.

        ``image_grid_thw`` is one ``(t, h, w)`` or ``[k, 3]`` for ``k`` images whose patches
        are concatenated in ``pixel_values``; their embeddings come back concatenated too.
        """
        grids = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
        pixel_values = np.ascontiguousarray(pixel_values, dtype=np.float32)
        expected = int(grids.prod(axis=1).sum())
        if pixel_values.ndim != 2 or pixel_values.shape[0] != expected:
            raise ValueError(
                f"pixel_values {pixel_values.shape} do not match grids {grids.tolist()} "
                f"({expected} patches)"
            )
        if (grids[:, 1:] % self.merge_size).any():
            raise ValueError(f"grid h/w must be multiples of merge_size={self.merge_size}")
        return self.run_graph(**graph_inputs(pixel_values, grids, self.merge_size))

    @abstractmethod
    def run_graph(
        self, pixel_values: np.ndarray, position_ids: np.ndarray, segment_ids: np.ndarray
    ) -> np.ndarray:
        """Run the graph on its raw inputs (what the Triton ``vision_encoder`` model gets)."""

    def _set_identity(self, meta: dict[str, str]) -> None:
        try:
            self.encoder_id = meta[META_ENCODER_ID]
            self.merge_size = int(meta[META_MERGE_SIZE])
            self.hidden_size = int(meta[META_HIDDEN_SIZE])
        except KeyError as e:
            raise ValueError(
                f"ONNX file lacks {e.args[0]!r} metadata: not made by export_vision_encoder"
            ) from e


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

    def run_graph(
        self, pixel_values: np.ndarray, position_ids: np.ndarray, segment_ids: np.ndarray
    ) -> np.ndarray:
        feeds = dict(zip(INPUT_NAMES, (pixel_values, position_ids, segment_ids), strict=True))
        return self._session.run([OUTPUT_NAME], feeds)[0]


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
    """GPU inference with TensorRT (10.x Python API), engine built from the ONNX file.

    Untested: this code has never run. It was written for GPU hosts; the development and CI
    machines have no GPU and cannot install ``tensorrt``, so ``tensorrt`` and ``torch.cuda``
    (used for device buffers and the stream) are imported only when an instance is made.
    The engine has one optimization profile over the patch axis (``min/opt/max_patches``,
    multiples of ``merge_size**2``); a serialized engine is cached at ``engine_path``.
    """

    def __init__(
        self,
        onnx_path: str | Path,
        engine_path: str | Path | None = None,
        min_patches: int = 4,
        opt_patches: int = 1024,
        max_patches: int = 16384,
        fp16: bool = False,
        workspace_bytes: int = 2 << 30,
    ) -> None:
        import onnx

        trt, torch = require_tensorrt()
        self._trt, self._torch = trt, torch
        onnx_path = Path(onnx_path)
        meta = onnx.load(str(onnx_path), load_external_data=False).metadata_props
        self._set_identity({p.key: p.value for p in meta})
        self._logger = trt.Logger(trt.Logger.WARNING)
        engine_path = Path(engine_path) if engine_path else onnx_path.with_suffix(".plan")
        if engine_path.exists():
            serialized = engine_path.read_bytes()
        else:
            serialized = self._build(
                onnx_path, min_patches, opt_patches, max_patches, fp16, workspace_bytes
            )
            engine_path.write_bytes(serialized)
        self._engine = trt.Runtime(self._logger).deserialize_cuda_engine(serialized)
        if self._engine is None:
            raise RuntimeError(f"cannot deserialize TensorRT engine {engine_path}")
        self._context = self._engine.create_execution_context()

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
            tail = tuple(tensor.shape)[1:]
            profile.set_shape(tensor.name, (lo, *tail), (opt, *tail), (hi, *tail))
        config.add_optimization_profile(profile)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise RuntimeError(f"TensorRT engine build failed for {onnx_path}")
        return bytes(serialized)

    def run_graph(
        self, pixel_values: np.ndarray, position_ids: np.ndarray, segment_ids: np.ndarray
    ) -> np.ndarray:
        trt, torch = self._trt, self._torch
        keep = []
        for name, array in zip(INPUT_NAMES, (pixel_values, position_ids, segment_ids), strict=True):
            dtype = trt.nptype(self._engine.get_tensor_dtype(name))
            device = torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)).cuda()
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


def make_encoder_runtime(
    kind: Literal["onnxruntime", "tensorrt"], onnx_path: str | Path, **options: object
) -> VisionEncoderRuntime:
    """Build the runtime named by ``kind``; its backend library is imported only then."""
    if kind == "onnxruntime":
        return OnnxRuntimeEncoder(onnx_path, **options)
    if kind == "tensorrt":
        return TensorRTEncoder(onnx_path, **options)
    raise ValueError(f"unknown encoder runtime {kind!r} (expected 'onnxruntime' or 'tensorrt')")
