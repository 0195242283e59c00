"""Wire format: QuantizedParams <-> a flat list of numpy arrays (no pickle).

Layout of ``to_wire(qparams, version)``:

  arrays[0]  uint8, UTF-8 JSON header:
             {"format": "actorq-wire", "format_version": 1, "version": <params version>,
              "num_arrays": <len(arrays)>, "packing": "lsb-bitstream",
              "leaves": [<entry>, ...]}
  arrays[1:] 1-D little-endian data arrays referenced by the entries.

Each entry has "path" (the key path: str for dict keys, int for list/tuple
indices; [] for a tree that is a single leaf), "kind" and kind-specific fields:

  "quantized"  shape, dtype ("int8"), bits, granularity, symmetric,
               arrays=[values, scale(, zero_point)]
               values: uint8; bits == 8 -> the int8 bytes; bits < 8 -> u = q + 2^(b-1)
               packed densely as a little-endian bitstream (value i at bit i*b;
               4 bits = two per byte, 2 bits = four per byte, 3/5/6/7 bits across
               byte boundaries), ceil(n*b/8) bytes.
               scale: float32 (N values per-channel, 1 per-tensor); zero_point: int32.
  "half"       shape, dtype ("float16" | "bfloat16"), arrays=[uint16 bit pattern]
  "array"      shape, dtype (numpy name: float32, int32, bool, ...), arrays=[raw]
  "empty_dict" / "empty_list"  an empty container, no arrays.

``from_wire(to_wire(q))`` is bit-exact. Given ``like`` (the receiving network's
tree), the payload comes back in ``like``'s structure (tuples stay tuples); without
it, containers come back as dicts (keys in payload order) and lists.

Optional header key "meta": a JSON object of numbers the publisher sends along
(e.g. the learner's maximum priority); read it with ``wire_meta(arrays)``.

A payload whose scales or float leaves are not finite, or whose dequantized
values would overflow float32, is malformed (ValueError): an actor would turn it
into NaN actions.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from actorq_jax.quantization.config import INT_BITS
from actorq_jax.quantization.core import QuantizedParams, QuantizedTensor, is_quantized_leaf

FORMAT = "actorq-wire"
FORMAT_VERSION = 1

_HALF_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(jnp.bfloat16)}
_RAW_DTYPES = {
    np.dtype(t).name: np.dtype(t).newbyteorder("<")
    for t in (np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
              np.int64, np.uint64, np.float32, np.float64)
}


# ----------------------------------------------------------------------------- bit packing

def packed_nbytes(n: int, bits: int) -> int:
    """Bytes holding n values of ``bits`` bits each (dense bitstream)."""
    return (n * bits + 7) // 8


def _rep(v: int, lane: int) -> np.uint64:
    """v repeated in every ``lane``-bit lane of a uint64."""
    out = 0
    for off in range(0, 64, lane):
        out |= v << off
    return np.uint64(out)


# 8 packed values of b bits are b bytes, read/written as fields of power-of-two
# widths (3 = 2+1, 5 = 4+1, 6 = 4+2, 7 = 4+2+1) of a structured dtype.
_GROUP_PARTS = {1: (1,), 2: (2,), 3: (2, 1), 4: (4,), 5: (4, 1), 6: (4, 2), 7: (4, 2, 1)}


def _group_dtype(bits: int):
    parts = _GROUP_PARTS[bits]
    offsets = [sum(parts[:i]) for i in range(len(parts))]
    dtype = np.dtype({"names": [f"f{i}" for i in range(len(parts))],
                      "formats": [f"<u{p}" for p in parts], "offsets": offsets, "itemsize": bits})
    return dtype, offsets


# The packers below work on 8 values at a time held in one uint64 (one byte
# each) and move bit fields with shifts and masks ("SWAR"), fully vectorised.
# Three stages merge byte fields into 16-, 32- then 64-bit lanes, so 8 values of
# b bits end up in the low 8*b bits (= b bytes) of each uint64.

def pack_values(q: np.ndarray, bits: int) -> np.ndarray:
    """int8 values in [-2^(b-1), 2^(b-1)-1] -> uint8 bitstream.

    Layout: u = q + 2^(b-1) (offset binary, 0..2^b-1), value i at bit offset
    i*bits of a little-endian bitstream, ceil(n*bits/8) bytes, padding bits 0.
    bits == 8 returns the int8 bytes unchanged (a view).
    """
    q = np.ascontiguousarray(q, dtype=np.int8).reshape(-1)
    if bits == 8:
        return q.view(np.uint8)
    n = q.size
    m = 1 << (bits - 1)
    pad = (-n) % 8
    if pad:
        q = np.concatenate([q, np.full(pad, -m, np.int8)])
    x = q.view("<u8")
    # q's low b bits are its b-bit two's complement; flipping bit b-1 gives q + 2^(b-1).
    x = (x ^ _rep(m, 8)) & _rep((1 << bits) - 1, 8)
    for lane, width in ((16, bits), (32, 2 * bits), (64, 4 * bits)):
        t = x >> np.uint64(lane // 2 - width)
        t &= _rep(((1 << width) - 1) << width, lane)
        x &= _rep((1 << width) - 1, lane)
        x |= t
    # Keep the low `bits` bytes of each uint64, written through aligned-width fields.
    dtype, offsets = _group_dtype(bits)
    out = np.empty(x.size, dtype)
    for name, off in zip(dtype.names, offsets):
        np.copyto(out[name], x >> np.uint64(8 * off) if off else x, casting="unsafe")
    return out.view(np.uint8)[:packed_nbytes(n, bits)]


def unpack_values(packed: np.ndarray, n: int, bits: int) -> np.ndarray:
    """Inverse of pack_values: n int8 values from the bitstream (a view when bits == 8)."""
    packed = np.ascontiguousarray(packed, dtype=np.uint8).reshape(-1)
    if bits == 8:
        return packed[:n].view(np.int8)
    m = 1 << (bits - 1)
    groups = -(-n // 8)
    if packed.size != groups * bits:  # the last group was cut short: zero-pad it
        full = np.zeros(groups * bits, np.uint8)
        full[:packed.size] = packed[:groups * bits]
        packed = full
    dtype, offsets = _group_dtype(bits)
    fields = packed.view(dtype)
    x = fields[dtype.names[0]].astype("<u8")
    for name, off in zip(dtype.names[1:], offsets[1:]):
        x |= fields[name].astype("<u8") << np.uint64(8 * off)
    for lane, width in ((64, 4 * bits), (32, 2 * bits), (16, bits)):
        half = lane // 2
        t = x << np.uint64(half - width)
        t &= _rep(((1 << width) - 1) << half, lane)
        x &= _rep((1 << width) - 1, lane)
        x |= t
    # Offset binary -> two's complement int8, per byte and without carries:
    # flip bit b-1, then copy it into bits b..7 (sign extension).
    x ^= _rep(m, 8)
    t = x & _rep(m, 8)
    t *= np.uint64((256 - 2 * m) // m)
    x |= t
    return x.view(np.int8)[:n]


# ----------------------------------------------------------------------------- tree walking

def _path_str(path: Sequence[Any]) -> str:
    return "/".join(str(k) for k in path) if len(path) else "<root>"


def _walk(tree, path, out):
    """Yields (path, node) for leaves, QuantizedTensors and empty containers, in order."""
    if is_quantized_leaf(tree):
        out.append((path, tree))
    elif isinstance(tree, Mapping):
        if not tree:
            out.append((path, "empty_dict"))
        for k, v in tree.items():
            if not isinstance(k, str):
                raise ValueError(f"{_path_str(path)}: dict keys must be str on the wire, got {k!r}")
            _walk(v, path + (k,), out)
    elif isinstance(tree, (list, tuple)):
        if not tree:
            out.append((path, "empty_list"))
        for i, v in enumerate(tree):
            _walk(v, path + (i,), out)
    elif tree is None:
        raise ValueError(f"{_path_str(path)}: None leaves cannot travel on the wire")
    else:
        out.append((path, tree))
    return out


def _key_str(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


# ----------------------------------------------------------------------------- to_wire

def _le(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.reshape(-1)


def _add_quantized(path: Tuple, node: Any, entry: Dict[str, Any], arrays: List[np.ndarray]) -> None:
    """Appends a QuantizedTensor's packed values, scales (and zero points) to `arrays`; describes them in `entry`."""
    bits = int(node.bits)
    if bits not in INT_BITS:
        raise ValueError(f"{_path_str(path)}: QuantizedTensor bits={bits} not in 2..8")
    values = np.asarray(node.values)
    if values.dtype != np.int8:
        raise ValueError(f"{_path_str(path)}: QuantizedTensor values must be int8, got {values.dtype}")
    scale = np.asarray(node.scale, dtype=np.float32)
    want = () if scale.ndim == 0 else values.shape[-1:]
    if scale.shape != want:
        raise ValueError(f"{_path_str(path)}: scale shape {scale.shape} does not fit values "
                         f"{values.shape} (expected () or (N,) over the last axis)")
    if node.zero_point is not None and np.shape(node.zero_point) != scale.shape:
        raise ValueError(f"{_path_str(path)}: zero_point shape {np.shape(node.zero_point)} "
                         f"!= scale shape {scale.shape}")
    packed = pack_values(values, bits)
    entry.update(kind="quantized", shape=list(values.shape), dtype="int8", bits=bits,
                 granularity="per_tensor" if scale.ndim == 0 else "per_channel",
                 symmetric=node.zero_point is None)
    refs = [len(arrays), len(arrays) + 1]
    arrays += [packed, _le(scale)]
    if node.zero_point is not None:
        refs.append(len(arrays))
        arrays.append(_le(np.asarray(node.zero_point, dtype=np.int32)))
    entry["arrays"] = refs


def _add_array(path: Tuple, node: Any, entry: Dict[str, Any], arrays: List[np.ndarray]) -> None:
    """Appends a float, half or integer leaf to `arrays` as little-endian bytes; describes it in `entry`."""
    a = np.asarray(node)
    name = a.dtype.name
    if name in _HALF_DTYPES:
        entry.update(kind="half", shape=list(a.shape), dtype=name)
        data = _le(a.view(np.uint16))
    elif name in _RAW_DTYPES:
        entry.update(kind="array", shape=list(a.shape), dtype=name)
        data = _le(a)
    else:
        raise ValueError(f"{_path_str(path)}: dtype {a.dtype} cannot travel on the wire")
    entry["arrays"] = [len(arrays)]
    arrays.append(data)


def to_wire(qparams: QuantizedParams, version: int = 0,
            meta: Optional[Dict[str, float]] = None) -> List[np.ndarray]:
    """Flat list of numpy arrays (a JSON header, then data) that Reverb can carry.

    ``version`` (e.g. the learner step) travels in the header and comes back from
    ``from_wire``; ``meta`` (finite numbers by name) comes back from ``wire_meta``.
    """
    if isinstance(version, (bool, np.bool_)) or not isinstance(version, (int, np.integer)):
        raise ValueError(f"version must be an int, got {version!r}")
    meta = _check_meta(meta or {}, ValueError)
    nodes = _walk(qparams, (), [])
    # One device->host transfer for all leaves.
    host = jax.device_get([n for _, n in nodes if not isinstance(n, str)])
    host_iter = iter(host)
    arrays: List[np.ndarray] = [None]  # placeholder for the header
    entries = []
    for path, node in nodes:
        entry = {"path": list(path)}
        if isinstance(node, str):
            entry["kind"] = node
            entries.append(entry)
            continue
        node = next(host_iter)
        if is_quantized_leaf(node):
            _add_quantized(path, node, entry, arrays)
        else:
            _add_array(path, node, entry, arrays)
        entries.append(entry)
    header = {"format": FORMAT, "format_version": FORMAT_VERSION, "version": int(version),
              "num_arrays": len(arrays), "packing": "lsb-bitstream", "leaves": entries}
    if meta:
        header["meta"] = meta
    arrays[0] = np.frombuffer(json.dumps(header, separators=(",", ":")).encode("utf-8"),
                              dtype=np.uint8)
    return arrays


def _check_meta(meta: Any, error: Any) -> Dict[str, float]:
    """meta as {str: finite float}; raises `error` naming the bad entry."""
    if not isinstance(meta, Mapping):
        raise error(f"meta must be a mapping of names to numbers, got {meta!r}")
    out = {}
    for key, value in meta.items():
        if (not isinstance(key, str) or isinstance(value, (bool, np.bool_))
                or not isinstance(value, (int, float, np.integer, np.floating)) or not np.isfinite(value)):
            raise error(f"meta entry {key!r}: {value!r} is not a finite number")
        out[key] = float(value)
    return out


def wire_meta(arrays: Sequence[np.ndarray]) -> Dict[str, float]:
    """The header's "meta" numbers ({} when the publisher sent none); ValueError when malformed."""
    return _check_meta(_parse_header(arrays).get("meta", {}), _bad)


def wire_nbytes(arrays: Sequence[np.ndarray]) -> int:
    """Total bytes of a wire payload (header included)."""
    return int(sum(np.asarray(a).nbytes for a in arrays))


# ----------------------------------------------------------------------------- from_wire

def _bad(msg: str) -> ValueError:
    return ValueError(f"malformed wire payload: {msg}")


def _parse_header(arrays) -> dict:
    if not isinstance(arrays, (list, tuple)) or len(arrays) == 0:
        raise _bad("expected a non-empty list of arrays")
    h = np.asarray(arrays[0])
    if h.dtype != np.uint8 or h.ndim != 1:
        raise _bad(f"array 0 (the header) must be 1-D uint8, got {h.dtype} {h.shape}")
    try:
        header = json.loads(h.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(f"header is not UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise _bad("header is not a JSON object")
    if header.get("format") != FORMAT:
        raise _bad(f"header format {header.get('format')!r} != {FORMAT!r}")
    if header.get("format_version") != FORMAT_VERSION:
        raise _bad(f"unsupported format_version {header.get('format_version')!r} "
                   f"(this reader understands {FORMAT_VERSION})")
    if header.get("packing", "lsb-bitstream") != "lsb-bitstream":
        raise _bad(f"unknown packing {header.get('packing')!r}")
    version = header.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise _bad(f"version must be an int, got {version!r}")
    if header.get("num_arrays") != len(arrays):
        raise _bad(f"header announces {header.get('num_arrays')!r} arrays, got {len(arrays)}")
    if not isinstance(header.get("leaves"), list):
        raise _bad("header has no 'leaves' list")
    return header


def _shape(entry, where) -> tuple:
    shape = entry.get("shape")
    if (not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise _bad(f"{where}: bad shape {shape!r}")
    return tuple(shape)


def _data(arrays, entry, i, where, dtype, size) -> np.ndarray:
    refs = entry.get("arrays")
    if not isinstance(refs, list) or i >= len(refs):
        raise _bad(f"{where}: missing array reference {i}")
    idx = refs[i]
    if isinstance(idx, bool) or not isinstance(idx, int) or not 1 <= idx < len(arrays):
        raise _bad(f"{where}: array index {idx!r} out of range")
    a = np.asarray(arrays[idx])
    if a.dtype.newbyteorder("=") != np.dtype(dtype).newbyteorder("="):
        raise _bad(f"{where}: array {idx} has dtype {a.dtype}, expected {np.dtype(dtype).name}")
    if a.size != size:
        raise _bad(f"{where}: array {idx} has {a.size} elements, expected {size}")
    return a.reshape(-1)


def _decode_leaf(arrays, entry, where):
    kind = entry.get("kind")
    if kind == "quantized":
        shape = _shape(entry, where)
        if len(shape) < 1:
            raise _bad(f"{where}: a quantized leaf needs ndim >= 1")
        bits = entry.get("bits")
        if bits not in INT_BITS or isinstance(bits, bool):
            raise _bad(f"{where}: bits {bits!r} not in 2..8")
        gran = entry.get("granularity")
        if gran not in ("per_channel", "per_tensor"):
            raise _bad(f"{where}: unknown granularity {gran!r}")
        if entry.get("dtype", "int8") != "int8":
            raise _bad(f"{where}: quantized values must be int8, header says {entry.get('dtype')!r}")
        symmetric = entry.get("symmetric")
        if not isinstance(symmetric, bool):
            raise _bad(f"{where}: symmetric must be a bool, got {symmetric!r}")
        n = int(np.prod(shape))
        n_scale = shape[-1] if gran == "per_channel" else 1
        packed = _data(arrays, entry, 0, where, np.uint8, packed_nbytes(n, bits))
        values = unpack_values(packed, n, bits).reshape(shape)
        scale_shape = (n_scale,) if gran == "per_channel" else ()
        scale = _data(arrays, entry, 1, where, np.float32, n_scale).astype(np.float32, copy=False)
        scale = scale.reshape(scale_shape)
        zp = None
        if not symmetric:
            zp = _data(arrays, entry, 2, where, np.int32, n_scale).astype(np.int32, copy=False)
            zp = zp.reshape(scale_shape)
        if len(entry["arrays"]) != (2 if symmetric else 3):
            raise _bad(f"{where}: wrong number of arrays for a quantized leaf")
        _check_dequantizable(scale, zp, bits, where)
        return QuantizedTensor(values=values, scale=scale, zero_point=zp, bits=bits)
    if kind in ("half", "array"):
        shape = _shape(entry, where)
        dtypes = _HALF_DTYPES if kind == "half" else _RAW_DTYPES
        name = entry.get("dtype")
        if name not in dtypes:
            raise _bad(f"{where}: unknown {kind} dtype {name!r}")
        n = int(np.prod(shape))
        if kind == "half":
            raw = _data(arrays, entry, 0, where, np.uint16, n)
            out = raw.astype("<u2", copy=False).view(dtypes[name])
        else:
            out = _data(arrays, entry, 0, where, dtypes[name], n).astype(dtypes[name], copy=False)
        if len(entry["arrays"]) != 1:
            raise _bad(f"{where}: wrong number of arrays for a {kind} leaf")
        if np.issubdtype(out.dtype, np.floating) or kind == "half":
            with np.errstate(invalid="ignore"):
                finite = bool(np.all(np.isfinite(out)))
            if not finite:
                raise _bad(f"{where}: float leaf holds NaN or inf")
        return out.reshape(shape)
    raise _bad(f"{where}: unknown kind {kind!r}")


_F32_MAX = float(np.finfo(np.float32).max)


def _check_dequantizable(scale: np.ndarray, zero_point: Optional[np.ndarray], bits: int, where: str) -> None:
    """Rejects scales that are not finite, or that would make (values - zero_point) * scale overflow float32."""
    if not np.all(np.isfinite(scale)):
        raise _bad(f"{where}: scale holds NaN or inf")
    if scale.size == 0:
        return
    offset = 0.0 if zero_point is None else float(np.max(np.abs(zero_point.astype(np.float64))))
    bound = float(np.max(np.abs(scale.astype(np.float64)))) * (2.0 ** (bits - 1) + offset)
    if bound > _F32_MAX:
        raise _bad(f"{where}: scale and zero point would dequantize past float32's range ({bound:.3g})")


def _insert(root, path, value, where):
    """Places value at path inside nested dicts/lists built so far; returns the new root."""
    if not path:
        if root is not _EMPTY:
            raise _bad(f"{where}: a root leaf cannot share the tree with other leaves")
        return value
    container_type = list if isinstance(path[0], int) else dict
    if root is _EMPTY:
        root = container_type()
    if not isinstance(root, container_type):
        raise _bad(f"{where}: inconsistent container at this path")
    key = path[0]
    if container_type is list:
        if key != len(root) and key != len(root) - 1:
            raise _bad(f"{where}: list indices out of order")
        if key == len(root):
            root.append(_EMPTY)
    elif key not in root:
        root[key] = _EMPTY
    child = root[key]
    if len(path) == 1:
        if child is not _EMPTY:
            raise _bad(f"{where}: duplicate path")
        root[key] = value
    else:
        root[key] = _insert(child, path[1:], value, where)
    return root


_EMPTY = object()


def from_wire(arrays: Sequence[np.ndarray], like: Optional[Any] = None) -> Tuple[QuantizedParams, int]:
    """(QuantizedParams, version) from a ``to_wire`` payload; bit-exact.

    With ``like`` (the receiving network's float params tree, or any tree of
    arrays/QuantizedTensors), the result has ``like``'s structure, and a payload
    whose leaf paths or shapes differ raises ValueError naming each mismatching
    leaf path. Malformed payloads raise ValueError. Leaves come back as jax
    arrays (one device_put for the tree). Unpacked (< 8 bit) values are fresh
    arrays; 8-bit values, halves and float leaves are views of ``arrays``, which
    jax on CPU may alias without a copy: do not write into the wire arrays afterwards.
    """
    header = _parse_header(arrays)
    nodes = _decode_nodes(arrays, header["leaves"])
    refs = sorted(i for e in header["leaves"] for i in e.get("arrays", []))
    if refs != list(range(1, len(arrays))):
        raise _bad("every data array must be referenced by exactly one leaf")
    root = _nest(nodes) if like is None else _shape_like(nodes, like)
    # One host->device transfer for the whole tree.
    return jax.device_put(root), int(header["version"])


def _decode_nodes(arrays, entries) -> List[Tuple[tuple, Any]]:
    """(path, value) of every header entry: decoded leaves, or {} / [] for empty containers."""
    if not entries:
        raise _bad("payload holds no leaves")
    nodes, seen = [], set()
    for entry in entries:
        if not isinstance(entry, dict):
            raise _bad("a leaf entry is not an object")
        path = entry.get("path")
        if (not isinstance(path, list)
                or not all(isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool) and k >= 0)
                           for k in path)):
            raise _bad(f"bad leaf path {path!r}")
        where = _path_str(path)
        if where in seen:
            raise _bad(f"{where}: duplicate path")
        seen.add(where)
        kind = entry.get("kind")
        if kind in ("empty_dict", "empty_list"):
            nodes.append((tuple(path), {} if kind == "empty_dict" else []))
        else:
            nodes.append((tuple(path), _decode_leaf(arrays, entry, where)))
    return nodes


def _nest(nodes) -> Any:
    """Nested dicts/lists from (path, value) pairs, checking that the paths form one tree."""
    root = _EMPTY
    for path, value in nodes:
        root = _insert(root, path, value, _path_str(path))
    return root


def _shape_like(nodes, like) -> Any:
    """The payload's leaves arranged in ``like``'s tree structure (ValueError naming leaves that differ)."""
    leaves = {_path_str(path): value for path, value in nodes if not isinstance(value, (dict, list))}
    shapes = {where: tuple(v.shape) for where, v in leaves.items()}
    flat, treedef = jax.tree_util.tree_flatten_with_path(like, is_leaf=is_quantized_leaf)
    wanted = [_path_str([_key_str(k) for k in kp]) for kp, _ in flat]
    _check_like(shapes, {where: tuple(int(d) for d in np.shape(leaf.values if is_quantized_leaf(leaf) else leaf))
                         for where, (_, leaf) in zip(wanted, flat)})
    return jax.tree_util.tree_unflatten(treedef, [leaves[where] for where in wanted])


def _check_like(shapes: dict, want: dict) -> None:
    problems = []
    for path, shape in shapes.items():
        if path not in want:
            problems.append(f"{path}: in the payload but not in the network")
        elif tuple(shape) != want[path]:
            problems.append(f"{path}: payload shape {tuple(shape)} != network shape {want[path]}")
    for path in want:
        if path not in shapes:
            problems.append(f"{path}: in the network but not in the payload")
    if problems:
        raise ValueError("payload does not fit the network: " + "; ".join(problems))
