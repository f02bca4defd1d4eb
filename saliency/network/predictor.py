"""Predictions of a trained saliency network: one image's map with the test-time options a user can score
(`predict_map`: mirror averaging, the dense CRF; `with_maps`: averaging with the handcrafted maps), and
`MaskPredictor`, the network as `saliency build-masks` runs it: batches of uint8 squares in, probability maps out.

`MaskPredictor` runs fp32 on the CPU; bf16 autocast and channels_last on a GPU. `launch` starts a batch and
returns a function that waits for it, so that the job writes the previous batch's records while the GPU runs.
On a GPU the job's ring of batches (shared memory, `mask_work.SlotRing`) is page-locked for CUDA once
(`register_host_memory`): squares go up from it and probabilities come down into it by DMA, with no
staging copy on the host. Memory that is not page-locked still works, through pinned copies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from relicv2.saliency.images import map_path, read_gray
from relicv2.saliency.network.config import CrfConfig
from relicv2.saliency.network.crf import dense_crf
from relicv2.saliency.network.images import resize_map, resize_square
from relicv2.saliency.network.model import SaliencyNet
from relicv2.saliency.network.model_file import load_model


def with_mirrors(batch: torch.Tensor) -> torch.Tensor:
    """N x C x H x W -> 2N: the batch, then each image mirrored left to right (one forward scores both)."""
    return torch.cat([batch, batch.flip(-1)])


def mirror_mean(probabilities: torch.Tensor) -> torch.Tensor:
    """2N x H x W predictions of `with_mirrors(batch)` -> N: each image's mean with its mirror's, mirrored back."""
    half = len(probabilities) // 2
    return (probabilities[:half] + probabilities[half:].flip(-1)) / 2


def predict_map(model: SaliencyNet, rgb: np.ndarray, size: int, *, flip: bool = False,
                crf: CrfConfig | None = None) -> np.ndarray:
    """The network's foreground probability of one displayed image (uint8 HxWx3), at the image's size;
    with `crf`, refined by the dense CRF on the network's input square first (`saliency.network.crf`)."""
    square = resize_square(rgb, size)
    batch = torch.from_numpy(square).permute(2, 0, 1)[None]
    probabilities = mirror_mean(model.predict(with_mirrors(batch))) if flip else model.predict(batch)
    probability = probabilities[0].cpu().numpy()
    if crf is not None:
        probability = dense_crf(square, probability, crf)
    return resize_map(probability, rgb.shape[1], rgb.shape[0])


def mean_of_maps(folder: Path, methods: Sequence[str], key: str) -> np.ndarray:
    """Per-pixel mean in [0, 1] of the maps ``folder/<method>/<key>.png`` of ``methods``."""
    return np.mean([read_gray(map_path(folder, m, key)) / 255.0 for m in methods], axis=0)


def with_maps(prediction: np.ndarray, maps_mean: np.ndarray) -> np.ndarray:
    """The mean of a network's prediction and the mean of the handcrafted maps (same HxW)."""
    if prediction.shape != maps_mean.shape:
        raise ValueError(f"prediction {prediction.shape} and maps {maps_mean.shape} differ in size")
    return (np.asarray(prediction, np.float64) + maps_mean) / 2.0


CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context, as torch's own staging does


class MaskPredictor:
    """Batched inference of a `saliency train` model file (see the module's docstring)."""

    def __init__(self, model_path: Path, device: str, *, flip: bool = False):
        self.model, self.info = load_model(model_path, device)
        self.size = int(self.info["input_size"])
        self.flip = flip  # average each image's prediction with its mirror's (twice the forward)
        self.cuda = device.startswith("cuda")
        if self.cuda:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.registered: tuple[int, int] | None = None  # (address, bytes) page-locked for CUDA

    def register_host_memory(self, address: int, nbytes: int) -> bool:
        """Page-lock [address, address + nbytes) for CUDA; False on the CPU or when the driver refuses
        (then batches in it go through pinned copies: slower, as correct)."""
        if not self.cuda:
            return False
        errors = []
        # In a thread of its own: a refusal is also CUDA's "last error" of the calling thread, which torch
        # reads after its next kernel launch in that thread and would report as that kernel's failure.
        worker = threading.Thread(target=lambda: errors.append(int(torch.cuda.cudart().cudaHostRegister(
            address, nbytes, CUDA_HOST_REGISTER_PORTABLE))), name="cuda-host-register")
        worker.start()
        worker.join()
        if errors != [0]:  # refused, or the call itself raised (printed by the thread)
            return False
        self.registered = (address, nbytes)
        return True

    def unregister_host_memory(self) -> None:
        """Undo `register_host_memory` (before the memory is unmapped)."""
        if self.registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self.registered[0])
            self.registered = None

    def _page_locked(self, array: np.ndarray) -> bool:
        if self.registered is None:
            return False
        start, nbytes = self.registered
        return start <= array.ctypes.data and array.ctypes.data + array.nbytes <= start + nbytes

    @torch.no_grad()
    def launch(self, squares: np.ndarray, out: np.ndarray) -> Callable[[], np.ndarray]:
        """Start the forward pass of uint8 squares [B, S, S, 3]; the returned function waits for it and
        returns `out` (float32 [B, S, S]) filled with the probabilities. `squares` may be reused once the
        returned function has returned."""
        batch = torch.from_numpy(squares)
        if self.cuda and not self._page_locked(squares):  # a pinned copy (the caching host allocator reuses it): the upload is asynchronous
            batch = torch.empty(batch.shape, dtype=torch.uint8, pin_memory=True).copy_(batch)
        x = self.model.normalise(batch.permute(0, 3, 1, 2))
        if self.flip:
            x = with_mirrors(x)
        if self.cuda:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model(x.contiguous(memory_format=torch.channels_last)).float()
        else:
            logits = self.model(x)
        result = torch.sigmoid(logits).squeeze(1)
        if self.flip:
            result = mirror_mean(result)
        if not self.cuda:
            torch.from_numpy(out).copy_(result)
            return lambda: out
        direct = self._page_locked(out)
        host = torch.from_numpy(out) if direct else torch.empty(result.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(result, non_blocking=True)
        done = torch.cuda.Event(blocking=True)  # the wait sleeps rather than spins: a core for the workers
        done.record()

        def wait() -> np.ndarray:
            done.synchronize()  # releases the GIL
            if not direct:
                np.copyto(out, host.numpy())
            return out

        return wait

    def __call__(self, squares: np.ndarray) -> np.ndarray:
        return self.launch(squares, np.empty((len(squares), self.size, self.size), np.float32))()


def launch_forward(predictor, squares: np.ndarray, out: np.ndarray) -> Callable[[], None]:
    """Start `predictor`'s forward of `squares`; the returned function waits for it with the probabilities
    in `out`. A predictor with `launch` (MaskPredictor, the benchmark's stand-in) may fill `out` itself;
    a plain callable (tests) runs now."""
    if not hasattr(predictor, "launch"):
        out[...] = predictor(squares)
        return lambda: None
    wait = predictor.launch(squares, out)

    def fill() -> None:
        if (probabilities := wait()) is not out:
            out[...] = probabilities

    return fill
