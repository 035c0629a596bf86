"""CUDA code paths on a machine without CUDA: fake tensors on a ``cuda`` device (``FakeTensorMode``).

Fake tensors carry shape, dtype and device and no data; an operator mixing devices raises
``FakeTensorDeviceMismatchError`` as it would fail on a GPU. The CPU-only build of PyTorch has no
CUDA device guard, which moving a tensor to ``cuda``, indexing one or recording autograd on one
ask for: ``install_device_guard`` registers c10's ``FakeGuardImpl`` for CUDA (a few lines of C++
against c10's headers, compiled once per torch build with the system's C++ compiler). What the build
still cannot do, ``fake_cuda()`` stands in for, each stand-in named here:

* ``Module.to`` converts each parameter and buffer in place (``sd.train.memory.module_moves_of_fake_tensors``):
  torch's own swaps fake parameters for new ones, which fails while the fake mode holds weak
  references to them.
* ``torch.Generator(device="cuda")``: a CPU generator that reports ``cuda`` as its device. Every
  random operator given a generator is checked: a generator of another device than the tensor it
  fills raises, as CUDA does (fake tensors do not check this).
* ``torch.cuda.is_available``/``is_bf16_supported`` say yes (so ``torch.autocast("cuda")`` is on);
  ``Event``, ``current_stream`` and ``synchronize`` do nothing: ordering between streams is not tested.
* ``pin_memory`` returns the tensor unpinned: pinned copies run as plain copies.
* Reads of values to the host (``tolist``, ``item``, ``bool``, ``numpy``) give zeros. Given a list,
  ``fake_cuda(syncs=...)`` also notes there every place the host would wait for the GPU: a read of a
  CUDA tensor's values, and a copy between a CUDA tensor and host memory without ``non_blocking``
  (what ``torch.cuda.set_sync_debug_mode("error")`` refuses on a GPU).
* ``Tensor.backward``: the autograd engine asks for the CUDA library's current streams, which this
  build does not have. The forward pass records its graph as on a GPU; the caller's stand-in then sets
  the gradients (zeros of each parameter's shape on its device): the backward pass is not exercised.
"""

from __future__ import annotations

import contextlib
import importlib

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import sd.train.memory

RealGenerator = torch.Generator
NUMPY_DTYPES = {torch.uint8: np.uint8, torch.bool: np.bool_, torch.int32: np.int32, torch.int64: np.int64,
                torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


class Generator(RealGenerator):
    """``torch.Generator`` whose ``device`` may be ``cuda``: the state is a CPU generator's."""

    def __new__(cls, device="cpu"):
        return super().__new__(cls)  # the CPU generator's state, whatever the device

    def __init__(self, device="cpu"):
        super().__init__()
        self._device = torch.device(device)
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", 0)

    @property
    def device(self):
        return self._device


class Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True


def _target_device(args, kwargs) -> torch.device:
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first.device if first is not None else torch.device("cpu")


class CudaStandIns(TorchFunctionMode):
    """The stand-ins of the module docstring that act on tensor calls."""

    def __init__(self, backward, syncs: list | None = None):
        super().__init__()
        self.backward = backward
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        generator = kwargs.get("generator")
        if generator is not None:
            target = _target_device(args, kwargs)
            if generator.device.type != target.type:
                raise RuntimeError(f"{name}: a generator on {generator.device} used for a tensor on {target}")
        if name == "pin_memory":
            return args[0]
        if self.syncs is not None and (name in sd.train.memory.HOST_READS or name == "numpy") \
                and args[0].device.type == "cuda":
            self.syncs.append(f"{name}() of a {tuple(args[0].shape)} CUDA tensor")
        if name in sd.train.memory.HOST_READS:
            return sd.train.memory.HOST_READS[name](args[0])
        if name == "numpy":
            return np.zeros(tuple(args[0].shape), dtype=NUMPY_DTYPES.get(args[0].dtype, np.float32))
        if name == "backward":
            return self.backward(args[0])
        return func(*args, **kwargs)


class HostWaits(TorchDispatchMode):
    """Notes every operator that makes the host wait for a CUDA device: reading a value, and a copy
    between a CUDA tensor and host memory that is not ``non_blocking``."""

    def __init__(self, syncs: list):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default and args[0].device.type == "cuda":
            self.syncs.append(f"a value read from a {tuple(args[0].shape)} CUDA tensor")
        elif func in (aten._to_copy.default, aten.copy_.default):
            source, target = (args[0], kwargs.get("device") or args[0].device) if func is aten._to_copy.default \
                else (args[1], args[0].device)
            blocking = not (kwargs.get("non_blocking") or (func is aten.copy_.default and len(args) > 2 and args[2]))
            devices = {source.device.type, torch.device(target).type}
            if blocking and devices == {"cuda", "cpu"} and source.dim() > 0:
                self.syncs.append(f"a blocking copy of a {tuple(source.shape)} tensor from {source.device.type} to "
                                  f"{torch.device(target).type}")
        return func(*args, **kwargs)


# Libraries that set themselves up for CUDA when first imported (bitsandbytes loads its CUDA kernels when
# CUDA is available, and diffusers' and peft's model code imports it) are imported while CUDA is not faked.
FIRST_IMPORTED = ("bitsandbytes", "peft", "diffusers.models.modeling_utils")


@contextlib.contextmanager
def fake_cuda(backward=lambda loss: None, syncs: list | None = None):
    """Run code written for CUDA on fake CUDA tensors (see the module docstring for what stands in);
    ``syncs``: a list to note there each place the host would wait for the GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    patches = {(torch, "Generator"): Generator, (torch.cuda, "is_available"): lambda: True,
               (torch.cuda, "is_bf16_supported"): lambda including_emulation=True: True,
               (torch.cuda, "Event"): Event, (torch.cuda, "current_stream"): lambda device=None: None,
               (torch.cuda, "synchronize"): lambda device=None: None}
    saved = {key: getattr(*key) for key in patches}
    install_device_guard()
    for library in FIRST_IMPORTED:
        importlib.import_module(library)
    # The fake mode first: it looks at torch.cuda.is_available() to keep device initialisation away.
    with FakeTensorMode(allow_non_fake_inputs=True):
        for (owner, name), value in patches.items():
            setattr(owner, name, value)
        try:
            waits = HostWaits(syncs) if syncs is not None else contextlib.nullcontext()
            with sd.train.memory.module_moves_of_fake_tensors(), CudaStandIns(backward, syncs), waits:
                yield
        finally:
            for (owner, name), value in saved.items():
                setattr(owner, name, value)


def zero_gradients(models: dict):
    """A ``backward`` for ``fake_cuda`` (autograd's engine does not run on fake tensors): gradients of zeros,
    of their parameters' shapes and devices, for the trainable parameters of every model in ``models`` (a
    dict filled once they are built)."""
    def backward(loss):
        for model in models.values():
            for parameter in model.parameters():
                if parameter.requires_grad:
                    parameter.grad = torch.zeros_like(parameter)

    return backward


def steady_steps(step, batch: list, syncs: list, count: int = 3):
    """``count`` training steps of ``step`` on ``batch``; returns the host waits noted in ``syncs`` after the
    first step (which makes the optimizer state and may wait once), and the last step's result."""
    import sd.model
    import sd.train.step

    with sd.model.attention_context(step.d.device):
        for i in range(count):
            if i == 1:
                syncs.clear()
            result = sd.train.step.train_step(step, batch, i)
    return list(syncs), result


GUARD_SOURCE = """
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

static c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> fake_cuda_guard;

extern "C" void install() {
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
  if (slot.load() == nullptr) slot.store(&fake_cuda_guard);
}
"""


def install_device_guard() -> None:
    """Register a CUDA device guard that only counts devices (c10's FakeGuardImpl); does nothing where
    CUDA has a real one. The library is compiled once per torch build (about a second: c10's headers
    only) into the temporary folder, and loaded with ctypes."""
    import ctypes
    import hashlib
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    torch_dir = Path(torch.__file__).parent
    key = hashlib.sha256(f"{GUARD_SOURCE}{torch.__version__}{torch_dir}".encode()).hexdigest()[:16]
    library = Path(tempfile.gettempdir()) / f"sd1_fake_cuda_guard_{key}.so"
    if not library.exists():
        source = library.with_suffix(".cpp")
        source.write_text(GUARD_SOURCE)
        partial = library.with_name(f"{library.name}.{os.getpid()}.tmp")
        subprocess.run([os.environ.get("CXX", "c++"), "-O1", "-std=c++17", "-shared", "-fPIC",
                        f"-I{torch_dir / 'include'}", str(source), f"-L{torch_dir / 'lib'}", "-lc10",
                        f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(partial)], check=True)
        os.replace(partial, library)
    ctypes.CDLL(str(library)).install()
