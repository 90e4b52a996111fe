"""The safetensors dtype vocabulary, and its numpy (ml_dtypes) equivalents.

Every format's reader maps its own dtype names onto this vocabulary so the
rest of the library speaks one language.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

NUMPY_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "C64": np.dtype(np.complex64),
    "C128": np.dtype(np.complex128),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}

# torch dtype attribute names (as they appear in pickles: torch.float32) -> vocabulary.
TORCH_DTYPE_NAMES: dict[str, str] = {
    "float64": "F64", "double": "F64",
    "float32": "F32", "float": "F32",
    "float16": "F16", "half": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
    "complex64": "C64", "cfloat": "C64",
    "complex128": "C128", "cdouble": "C128",
    "int64": "I64", "long": "I64",
    "int32": "I32", "int": "I32",
    "int16": "I16", "short": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}

# Legacy typed storage classes (torch.FloatStorage ...) -> vocabulary.
TORCH_STORAGE_NAMES: dict[str, str] = {
    "DoubleStorage": "F64",
    "FloatStorage": "F32",
    "HalfStorage": "F16",
    "BFloat16Storage": "BF16",
    "Float8_e4m3fnStorage": "F8_E4M3",
    "Float8_e5m2Storage": "F8_E5M2",
    "Float8_e4m3fnuzStorage": "F8_E4M3FNUZ",
    "Float8_e5m2fnuzStorage": "F8_E5M2FNUZ",
    "Float8_e8m0fnuStorage": "F8_E8M0",
    "ComplexFloatStorage": "C64",
    "ComplexDoubleStorage": "C128",
    "LongStorage": "I64",
    "IntStorage": "I32",
    "ShortStorage": "I16",
    "CharStorage": "I8",
    "ByteStorage": "U8",
    "UInt16Storage": "U16",
    "UInt32Storage": "U32",
    "UInt64Storage": "U64",
    "BoolStorage": "BOOL",
}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a vocabulary name; KeyError if unknown."""
    return NUMPY_DTYPES[name]


def itemsize(name: str) -> int:
    return NUMPY_DTYPES[name].itemsize


def is_floating(name: str) -> bool:
    """True for real floating-point dtypes (ml_dtypes' bf16/fp8 report numpy kind 'V', so ask by name)."""
    return name.startswith("F") or name == "BF16"

# vocabulary -> the canonical torch dtype attribute name (the first spelling of each in TORCH_DTYPE_NAMES)
TORCH_DTYPE_OF: dict[str, str] = {}
for _torch_name, _vocabulary in TORCH_DTYPE_NAMES.items():
    TORCH_DTYPE_OF.setdefault(_vocabulary, _torch_name)
