"""`save`/`load`: a flat vector and the structure it belongs to, in a plain `.npz` file.

The file holds `p` and a JSON header (leaf paths, shapes, dtypes, ties, frozen leaves,
transforms, versions). It is read with `allow_pickle=False`: nothing in it is ever executed.
"""

import dataclasses
import importlib.metadata
import json
import os
import tempfile
import zipfile
from typing import Any, TypeVar, overload

import jax
import jax.core  # `jax.core.Tracer`: imported explicitly so type checkers see it
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from ._custom_types import FilePath, FilterSpec, PyTree
from ._dtypes import check_representable, complex_dtype, is_complex
from ._flatten import Restructure, destructure
from ._layout import OTHER, TRAINABLE, Layout, Leaf, nonfinite_paths
from ._transforms import node_path, transforms_by_path
from ._validate import as_flat_vector


_M = TypeVar("_M")

FORMAT = "sciflat"
FORMAT_VERSION = 1
_HEADER = "sciflat_header"

#
# Arrays to and from NumPy: bfloat16 & co. are stored as raw unsigned ints.
#


def to_numpy(x) -> np.ndarray:
    x = np.asarray(x)
    # ml_dtypes (bfloat16, float8...): NumPy stores them as void, so store raw words.
    if x.dtype.kind == "V":
        return x.view(f"u{x.dtype.itemsize}")
    return x


def from_numpy(x: np.ndarray, dtype: str, path, name: str) -> np.ndarray:
    """`x` as read from the file at `path`, checked against the `dtype` its header
    gives: data that disagree with the header are an error, never silently cast."""
    want = jnp.dtype(dtype)
    stored = to_numpy(np.zeros(0, want)).dtype
    if x.dtype != stored:
        raise ValueError(
            f"{os.fspath(path)!r} is inconsistent: `{name}` holds {x.dtype.name} data "
            f"but the header says {want.name}. The file was not written by "
            "`sciflat.save`/`fit` as it is; write it again."
        )
    return x.view(want) if want.kind == "V" else x


def _check_concrete(x, who: str) -> None:
    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            f"{who} got a JAX tracer: it reads or writes a file, so call it outside "
            "`jax.jit`/`jax.grad`/`jax.vmap`, on concrete values (e.g. return `p` from "
            "the jitted function and save it afterwards)."
        )


#
# Writing: validate everything first, then write a temp file and rename it into place.
#


def header(p, re: Restructure) -> dict[str, Any]:
    dtype = np.dtype(p.dtype)
    # `re` rebuilds its trainable leaves in `p.dtype`, whatever it was made in.
    rebuilt = lambda x: complex_dtype(dtype, "") if is_complex(jnp.dtype(x)) else dtype
    leaves = [
        dataclasses.replace(x, dtype=str(rebuilt(x.dtype)))
        if x.kind == TRAINABLE
        else x
        for x in re.layout()
    ]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "sciflat_version": importlib.metadata.version("sciflat"),
        "restructure": repr(re),
        "dtype": str(dtype),
        "size": len(re),
        "leaves": Layout(leaves).to_json(),
        # Which leaves are a `sciflat.Transform`'s `raw`, and which transform
        # (a file without this key loads unchecked, as before).
        "transforms": transforms_by_path(re),
    }


def write_atomic(path, arrays: dict[str, np.ndarray], head: dict[str, Any]) -> None:
    """Writes an `.npz` next to `path` and renames it over `path`: never half a file."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"`path`: the folder {folder!r} does not exist.")
    arrays = {**arrays, _HEADER: np.array(json.dumps(head, allow_nan=False))}
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".sciflat-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            # The keys are array names, never `allow_pickle`.
            np.savez(f, **arrays)  # pyright: ignore[reportArgumentType]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # also Ctrl-C: leave no temp file behind
        os.unlink(tmp)
        raise


@overload
def save(
    path: FilePath,
    p_or_model: Float[Array, " n"],
    re: Restructure[Any],
    *,
    allow_nonfinite: bool = False,
) -> None: ...


@overload
def save(
    path: FilePath,
    p_or_model: PyTree[Any],
    re: None = None,
    *,
    allow_nonfinite: bool = False,
) -> None: ...


def save(
    path: FilePath,
    p_or_model: PyTree[Any],
    re: Restructure[Any] | None = None,
    *,
    allow_nonfinite: bool = False,
) -> None:
    """Saves a flat parameter vector with a description of the model it belongs to.

    Writes an `.npz` file (plain NumPy, no pickle) holding `p` and a JSON header:
    every leaf's path, shape and dtype, which leaves are trainable, frozen or tied,
    and the format and sciflat versions. Frozen and non-floating leaves are described
    but not stored: [`sciflat.load`][] takes them from the skeleton. The file appears
    atomically: a crash mid-write leaves any earlier file at `path` intact.

    !!! Example

        ```python
        sciflat.save("model.npz", model)  # or sciflat.save("model.npz", p, re)
        model = sciflat.load("model.npz", skeleton)
        ```

    **Arguments:**

    - `path`: the file to write (any name; `.npz` is conventional).
    - `p_or_model`: a flat vector `p` (then pass `re`), or a model, destructured with
        every floating leaf trainable.
    - `re`: the [`sciflat.Restructure`][] that `p` belongs to.
    - `allow_nonfinite`: save even if `p` holds NaN or infinity (refused by default).
    """
    if re is None:
        if isinstance(p_or_model, jax.Array | np.ndarray) and np.ndim(p_or_model) == 1:
            raise TypeError(
                "`save(path, p)` needs the `re` that `p` belongs to: "
                "`save(path, p, re)`, or pass the model itself: `save(path, model)`."
            )
        p, re = destructure(p_or_model)
    elif not isinstance(re, Restructure):
        raise TypeError(f"`re` must be a sciflat.Restructure, got {type(re).__name__}.")
    else:
        p = p_or_model
    _check_concrete(p, "`sciflat.save`")
    p = as_flat_vector(p, len(re), "`sciflat.save`")
    if not allow_nonfinite and (bad := nonfinite_paths(p, re)):
        raise ValueError(
            f"`p` holds NaN or infinity in {', '.join(f'`{b}`' for b in bad)}; nothing "
            "was written. Pass `allow_nonfinite=True` to save it anyway."
        )
    write_atomic(path, {"p": to_numpy(p)}, header(p, re))


#
# Reading: check the file against the skeleton, leaf by leaf.
#


def read(path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    name = repr(os.fspath(path))
    if os.path.exists(path) and not zipfile.is_zipfile(path):
        raise ValueError(f"{name} is not a sciflat file (not an .npz archive).")
    try:
        with np.load(os.fspath(path), allow_pickle=False) as z:
            if _HEADER not in z.files:
                raise ValueError(f"{name} is not a sciflat file (no header).")
            text = str(z[_HEADER])
            arrays = {k: z[k] for k in z.files if k != _HEADER}
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        if str(e).startswith(name):  # ours, already naming the file
            raise
        raise ValueError(
            f"{name} is damaged or not a sciflat file ({type(e).__name__}: {e}). "
            "Write it again, or restore a copy."
        ) from e
    try:
        head = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{name} is damaged: its header is not valid JSON ({e})."
        ) from e
    if head.get("format") != FORMAT or head.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{name} has format {head.get('format')!r} version "
            f"{head.get('format_version')}; this sciflat reads {FORMAT!r} up to version "
            f"{FORMAT_VERSION}. Update sciflat."
        )
    return head, arrays


def _describe(leaf: Leaf) -> str:
    tied = f" tied to `{leaf.tied_to}`" if leaf.tied_to else ""
    return f"{leaf.kind} {leaf.dtype}{list(leaf.shape)}{tied}"


def _key(leaf: Leaf):
    # A trainable or frozen leaf is rebuilt in the dtype of `p`: compare only real/complex.
    dtype = leaf.dtype
    if leaf.kind != OTHER:
        dtype = "complex" if is_complex(jnp.dtype(dtype)) else "real"
    return leaf.path, leaf.kind, leaf.shape, dtype, leaf.tied_to


def check_layout(entries: list[dict], re: Restructure, path) -> None:
    """Raises naming the first leaf where the file and the skeleton differ."""
    expected, found = re.layout(), [Leaf.from_json(e) for e in entries]
    for want, got in zip(expected, found, strict=False):
        if _key(want) != _key(got):
            same = want.path == got.path
            at = f"leaf `{want.path}`" + ("" if same else " of `like`")
            raise ValueError(
                f"{os.fspath(path)!r} does not fit `like` at {at}: expected "
                f"{_describe(want)}, found "
                + ("" if same else f"`{got.path}` ")
                + f"{_describe(got)} in the file."
            )
    if len(expected) != len(found):
        n = min(len(expected), len(found))
        extra, side = (found, "file") if len(found) > n else (expected, "model `like`")
        raise ValueError(
            f"{os.fspath(path)!r} does not fit `like`: the {side} has {len(extra)} "
            f"array leaves, the other {n}; the first extra one is `{extra[n].path}` "
            f"{_describe(extra[n])}."
        )


def check_transforms(saved: dict[str, str], re: Restructure, path) -> None:
    """Raises naming the first leaf whose transform differs between file and skeleton:
    the same numbers in `raw` are another value under another transform."""
    here = transforms_by_path(re)
    for leaf in sorted(set(saved) | set(here)):
        got, want = saved.get(leaf), here.get(leaf)
        if got != want:
            at = node_path(leaf) if (got and want) else leaf
            raise ValueError(
                f"{os.fspath(path)!r} does not fit `like` at leaf `{at}`: the file "
                f"holds it under {got or 'no transform'}, the model `like` has "
                f"{want or 'no transform'} there, so the saved numbers would mean "
                "another value. Load into a model with the transform it was saved "
                "with (and convert the value yourself if you want another)."
            )


def load_flat(path, re: Restructure, dtype, who: str) -> tuple[dict, dict, np.ndarray]:
    """The checked header, all arrays, and `p` in the dtype asked for."""
    head, arrays = read(path)
    check_layout(head["leaves"], re, path)
    if "transforms" in head:  # files written before it was recorded load unchecked
        check_transforms(head["transforms"], re, path)
    saved = np.dtype(jnp.dtype(head["dtype"]))
    if dtype is None:
        if saved != re.dtype:
            raise TypeError(
                f"{os.fspath(path)!r} holds {saved.name} parameters, but the skeleton "
                f"is {re.dtype.name}. Say which you want: `{who}(..., dtype=jnp."
                f"{saved.name})` keeps the file's precision, `dtype=jnp.{re.dtype.name}` "
                "converts to the skeleton's."
            )
        dtype = saved
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"`dtype` must be a real floating dtype, got {dtype.name}.")
    check_representable(dtype, "`dtype`")
    p = from_numpy(arrays.pop("p"), head["dtype"], path, "p")
    return head, arrays, p.astype(dtype)


@overload
def load(
    path: FilePath,
    like: Restructure[Any],
    *,
    filter_spec: FilterSpec = True,
    dtype: DTypeLike | None = None,
) -> Float[Array, " n"]: ...


@overload
def load(
    path: FilePath,
    like: _M,
    *,
    filter_spec: FilterSpec = True,
    dtype: DTypeLike | None = None,
) -> _M: ...


def load(
    path: FilePath,
    like: _M | Restructure[Any],
    *,
    filter_spec: FilterSpec = True,
    dtype: DTypeLike | None = None,
) -> _M | Float[Array, " n"]:
    """Loads what [`sciflat.save`][] wrote, after checking it fits a skeleton.

    The file's structure (leaf paths, shapes, real/complex, which leaves are trainable,
    frozen or tied) must match the skeleton's exactly; otherwise a `ValueError` names
    the first differing leaf. The file is read with `allow_pickle=False`. Converting to
    another precision is never silent: if the file's dtype differs from the
    skeleton's, pass `dtype=` to say which one you want.

    !!! Example

        ```python
        skeleton = eqx.nn.MLP(2, 1, 32, 2, key=jax.random.key(0))  # values ignored
        model = sciflat.load("model.npz", skeleton)
        ```

    **Arguments:**

    - `path`: the file.
    - `like`: a model of the same architecture (its frozen and non-floating leaves are
        used), or the [`sciflat.Restructure`][] the file's `p` belongs to.
    - `filter_spec`: when `like` is a model, which leaves are trainable, as given to
        [`sciflat.destructure`][] when the file was written.
    - `dtype`: the dtype to load `p` in. Default: the file's, which must then equal
        the skeleton's.

    **Returns:**

    The model (rebuilt in the loaded dtype) if `like` is a model, or `p` if `like` is a
    `Restructure`.
    """
    # With `dtype`, the skeleton is flattened in it: its own dtype may not hold a frozen
    # complex leaf (float16 has no complex counterpart) where the one asked for does.
    if isinstance(like, Restructure):
        re = like
    else:
        re = destructure(like, filter_spec, dtype=dtype)[1]
    _, _, p = load_flat(path, re, dtype, "sciflat.load")
    p = jnp.asarray(p)
    return p if isinstance(like, Restructure) else re(p)
