"""Every public function, fed what users get wrong: a clear error, and nothing written.

Each case writes (if it writes at all) into an empty folder, which must still be empty
after the error: no checkpoint, no half file, no temp file.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sciflat


MODEL = {"b": jnp.zeros(1), "w": jnp.ones(2)}
P, RE = sciflat.destructure(MODEL)
LOSS = lambda m: jnp.sum(m["w"] ** 2) + jnp.sum(m["b"] ** 2)
RESIDUALS = lambda m: jnp.concatenate([m["w"], m["b"]])
ADAM = optax.adam(1e-2)
OBJECT_MODEL = {"w": np.array([1.0, None], dtype=object)}
STRING_MODEL = {"w": np.array(["a", "b"])}


def _leaked_tracer():
    leaked = []
    jax.jit(lambda x: leaked.append(x) or x)(jnp.ones(3))
    return leaked[0]


LEAKED = _leaked_tracer()
TRACER = (jax.errors.UnexpectedTracerError, "unexpected tracer")


def fit(out, model=MODEL, loss=LOSS, optimizer=ADAM, **kwargs):
    """`sciflat.fit` checkpointing into the folder that must stay empty."""
    kwargs = {"steps": 3, "progress": False, **kwargs}
    return sciflat.fit(loss, model, optimizer, checkpoint=out / "ckpt.npz", **kwargs)


def save_inside_jit(out):
    jax.jit(lambda p: sciflat.save(out / "m.npz", p, RE) or p)(P)


def x64_off(f):
    def run(out):
        with jax.enable_x64(False):
            return f(out)

    return run


CASES = {
    # destructure
    "destructure/object leaf": (
        lambda out: sciflat.destructure(OBJECT_MODEL),
        TypeError,
        r"Leaf `\['w'\]` is an array of dtype object.*numeric arrays only",
    ),
    "destructure/string leaf": (
        lambda out: sciflat.destructure(STRING_MODEL),
        TypeError,
        r"`\['w'\]`.*numeric arrays only",
    ),
    "destructure/int dtype": (
        lambda out: sciflat.destructure(MODEL, dtype=jnp.int32),
        TypeError,
        "`dtype` must be a real floating dtype, got int32",
    ),
    "destructure/complex dtype": (
        lambda out: sciflat.destructure(MODEL, dtype=jnp.complex64),
        TypeError,
        "`dtype` must be a real floating dtype, got complex64",
    ),
    "destructure/complex leaf in bfloat16": (
        lambda out: sciflat.destructure(
            {"z": jnp.ones(2, jnp.complex64)}, dtype=jnp.bfloat16
        ),
        TypeError,
        r"`\['z'\]` is complex.*no complex counterpart",
    ),
    "destructure/float64 with x64 off": (
        x64_off(lambda out: sciflat.destructure({"w": np.ones(2)})),
        TypeError,
        "jax_enable_x64",
    ),
    "destructure/tie half frozen": (
        lambda out: sciflat.destructure({"a": P, "b": P}, {"a": True, "b": False}),
        ValueError,
        "trainable everywhere or frozen everywhere",
    ),
    "destructure/leaked tracer": (
        lambda out: sciflat.destructure({"w": LEAKED}),
        *TRACER,
    ),
    # re(p)
    "re/wrong length": (
        lambda out: RE(jnp.ones(4)),
        ValueError,
        "expected a vector of length 3, got 4",
    ),
    "re/int p": (
        lambda out: RE(jnp.arange(3)),
        TypeError,
        "real floating vector, got dtype int",
    ),
    "re/complex p": (
        lambda out: RE(jnp.ones(3, jnp.complex64)),
        TypeError,
        "real floating vector, got dtype complex64.*never become complex",
    ),
    "re/2-D p": (
        lambda out: RE(jnp.ones((3, 1))),
        ValueError,
        r"1-D vector.*shape \(3, 1\)",
    ),
    "re/object p": (
        lambda out: RE(np.array([1.0, None, 2.0], dtype=object)),
        TypeError,
        "got dtype object",
    ),
    "re/python float": (
        lambda out: RE(1.0),
        TypeError,
        "1-D real floating array, got float",
    ),
    "re/float64 NumPy with x64 off": (
        x64_off(lambda out: RE(np.ones(3))),
        TypeError,
        "jax_enable_x64",
    ),
    "re/leaked tracer": (lambda out: RE(LEAKED), *TRACER),
    # save
    "save/wrong length": (
        lambda out: sciflat.save(out / "m.npz", jnp.ones(2), RE),
        ValueError,
        "expected a vector of length 3, got 2",
    ),
    "save/int p": (
        lambda out: sciflat.save(out / "m.npz", jnp.arange(3), RE),
        TypeError,
        "real floating vector",
    ),
    "save/NaN in p": (
        lambda out: sciflat.save(out / "m.npz", P.at[2].set(jnp.nan), RE),
        ValueError,
        r"NaN or infinity in `\['w'\]`; nothing was written",
    ),
    "save/inf in model": (
        lambda out: sciflat.save(out / "m.npz", {"b": jnp.array([jnp.inf])}),
        ValueError,
        r"NaN or infinity in `\['b'\]`",
    ),
    "save/object p": (
        lambda out: sciflat.save(
            out / "m.npz", np.array([1.0, None, 2.0], dtype=object), RE
        ),
        TypeError,
        "got dtype object",
    ),
    "save/object model": (
        lambda out: sciflat.save(out / "m.npz", OBJECT_MODEL),
        TypeError,
        "numeric arrays",
    ),
    "save/p without re": (
        lambda out: sciflat.save(out / "m.npz", P),
        TypeError,
        "needs the `re`",
    ),
    "save/re not a Restructure": (
        lambda out: sciflat.save(out / "m.npz", P, MODEL),
        TypeError,
        "`re` must be a sciflat.Restructure, got dict",
    ),
    "save/inside jit": (
        save_inside_jit,
        TypeError,
        "got a JAX tracer.*outside `jax.jit`",
    ),
    "save/leaked tracer": (
        lambda out: sciflat.save(
            out / "m.npz", LEAKED, sciflat.destructure(jnp.ones(3))[1]
        ),
        TypeError,
        "got a JAX tracer",
    ),
    "save/missing folder": (
        lambda out: sciflat.save(out / "no" / "m.npz", MODEL),
        FileNotFoundError,
        "does not exist",
    ),
    # load (of a good file, written elsewhere)
    "load/another model": (
        lambda out: sciflat.load(GOOD_FILE, {"b": jnp.zeros(1), "w": jnp.ones(3)}),
        ValueError,
        r"leaf `\['w'\]`: expected trainable float64\[3\], found .*\[2\]",
    ),
    "load/int dtype": (
        lambda out: sciflat.load(GOOD_FILE, MODEL, dtype=jnp.int32),
        TypeError,
        "real floating dtype",
    ),
    "load/implicit float32": (
        lambda out: sciflat.load(
            GOOD_FILE, jax.tree.map(lambda x: x.astype(jnp.float32), MODEL)
        ),
        TypeError,
        "float64 parameters, but the skeleton is float32",
    ),
    "load/object skeleton": (
        lambda out: sciflat.load(GOOD_FILE, OBJECT_MODEL),
        TypeError,
        "numeric arrays",
    ),
    "load/missing file": (
        lambda out: sciflat.load(out / "nope.npz", MODEL),
        FileNotFoundError,
        "nope.npz",
    ),
    "load/not an npz": (
        lambda out: sciflat.load(GARBAGE_FILE, MODEL),
        ValueError,
        "not an .npz archive",
    ),
    # fit
    "fit/loss not callable": (
        lambda out: fit(out, loss=3.0),
        TypeError,
        "`loss` must be a function",
    ),
    "fit/optimizer factory not called": (
        lambda out: fit(out, optimizer=optax.adam),
        TypeError,
        r"GradientTransformation \(e.g. `optax.adam\(1e-3\)`\), got function",
    ),
    "fit/no steps or batches": (
        lambda out: fit(out, steps=None),
        ValueError,
        "Give `steps`",
    ),
    "fit/negative steps": (
        lambda out: fit(out, steps=-1),
        ValueError,
        "`steps` must be >= 0",
    ),
    "fit/float steps": (
        lambda out: fit(out, steps=10.0),
        TypeError,
        "`steps` must be an int",
    ),
    "fit/checkpoint_every 0": (
        lambda out: fit(out, checkpoint_every=0),
        ValueError,
        "`checkpoint_every` must be >= 1",
    ),
    "fit/args not a tuple": (
        lambda out: fit(out, args=jnp.ones(2)),
        TypeError,
        "`args` must be a tuple",
    ),
    "fit/batches not iterable": (
        lambda out: fit(out, batches=3),
        TypeError,
        "`batches` must be an iterable",
    ),
    "fit/empty batches": (
        lambda out: fit(out, batches=[]),
        ValueError,
        "`batches` is empty",
    ),
    "fit/vector loss": (
        lambda out: fit(out, loss=lambda m: m["w"]),
        TypeError,
        r"`loss` must return a real scalar, got float64\[2\]",
    ),
    "fit/complex loss": (
        lambda out: fit(out, loss=lambda m: jnp.sum(m["w"]) * 1j),
        TypeError,
        "real scalar, got complex128",
    ),
    "fit/NaN in model": (
        lambda out: fit(out, model={"b": jnp.zeros(1), "w": jnp.array([1.0, jnp.nan])}),
        ValueError,
        r"`fit`: the starting point is not finite in `\['w'\]`",
    ),
    "fit/empty model": (
        lambda out: fit(out, model=()),
        ValueError,
        "no trainable floating",
    ),
    "fit/only int leaves": (
        lambda out: fit(out, model={"n": jnp.arange(3)}),
        ValueError,
        "no trainable floating",
    ),
    "fit/object leaf": (
        lambda out: fit(out, model=OBJECT_MODEL),
        TypeError,
        "numeric arrays",
    ),
    "fit/int dtype": (
        lambda out: fit(out, dtype=jnp.int32),
        TypeError,
        "real floating dtype",
    ),
    "fit/float64 with x64 off": (
        x64_off(lambda out: fit(out, dtype=jnp.float64)),
        TypeError,
        "jax_enable_x64",
    ),
    "fit/checkpoint folder missing": (
        lambda out: sciflat.fit(
            LOSS, MODEL, ADAM, steps=2, checkpoint=out / "no" / "c.npz"
        ),
        FileNotFoundError,
        "does not exist",
    ),
    "fit/leaked tracer": (lambda out: fit(out, model={"w": LEAKED}), *TRACER),
}


# The SciPy fits, where they exist (another module): the same mistakes.
for name, f in [("minimize", LOSS), ("least_squares", RESIDUALS)]:
    if not hasattr(sciflat, name):
        continue
    run = lambda model=MODEL, f=f, name=name, **kw: getattr(sciflat, name)(
        f, model, progress=False, **kw
    )
    CASES |= {
        f"{name}/wrong length x0": (
            lambda out, run=run: run(x0=np.zeros(2)),
            ValueError,
            "length 3, got 2",
        ),
        f"{name}/NaN in x0": (
            lambda out, run=run: run(x0=np.array([np.nan, 0.0, 0.0])),
            ValueError,
            r"not finite in `\['b'\]`",
        ),
        f"{name}/empty model": (
            lambda out, run=run: run(model=()),
            ValueError,
            "no trainable floating",
        ),
        f"{name}/only int leaves": (
            lambda out, run=run: run(model={"n": jnp.arange(3)}),
            ValueError,
            "no trainable floating",
        ),
        f"{name}/object leaf": (
            lambda out, run=run: run(model=OBJECT_MODEL),
            TypeError,
            "numeric arrays",
        ),
        f"{name}/bounds for an unknown leaf": (
            lambda out, run=run: run(bounds={"zz": (0.0, 1.0)}),
            ValueError,
            "does not pick a trainable leaf",
        ),
        f"{name}/bounds of the wrong shape": (
            lambda out, run=run: run(bounds={"['w']": (np.zeros(3), None)}),
            ValueError,
            r"`\['w'\]`.*shape \(2,\), got shape \(3,\)",
        ),
        f"{name}/bounds not model-shaped": (
            lambda out, run=run: run(bounds=({"w": 0.0}, None)),
            ValueError,
            "pytrees with the model's structure",
        ),
        f"{name}/x64 off": (
            x64_off(lambda out, run=run: run()),
            TypeError,
            "jax_enable_x64",
        ),
        f"{name}/leaked tracer": (
            lambda out, run=run: run(model={"w": LEAKED}),
            *TRACER,
        ),
    }


@pytest.fixture(scope="module", autouse=True)
def files(tmp_path_factory):
    global GOOD_FILE, GARBAGE_FILE
    folder = tmp_path_factory.mktemp("inputs")
    GOOD_FILE, GARBAGE_FILE = folder / "good.npz", folder / "garbage.npz"
    sciflat.save(GOOD_FILE, MODEL)
    GARBAGE_FILE.write_bytes(b"not a zip file")


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_a_clear_error_and_writes_nothing(name, tmp_path):
    call, error, match = CASES[name]
    with pytest.raises(error, match=match):
        call(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_every_public_function_is_tried():
    functions = {"destructure", "save", "load", "fit", "minimize", "least_squares"}
    covered = {case.split("/")[0] for case in CASES}
    assert {n for n in functions if hasattr(sciflat, n)} | {"re"} <= covered


def test_a_failing_loss_mid_fit_leaves_only_complete_checkpoints(tmp_path):
    # Not bad input but bad luck: a user's callback raises at step 4.
    def callback(step, value, model):
        if step == 4:
            raise RuntimeError("user bug")

    with pytest.raises(RuntimeError, match="user bug"):
        fit(tmp_path, steps=10, checkpoint_every=3, callback=callback)
    assert [f.name for f in tmp_path.iterdir()] == ["ckpt.npz"]
    with np.load(tmp_path / "ckpt.npz", allow_pickle=False) as z:
        assert len(z["history"]) == 3  # step 3's checkpoint, complete
    assert sciflat.load(tmp_path / "ckpt.npz", RE).shape == P.shape


#
# Issue 23, items 17-21: where two features meet, the error says what is wrong and
# the fix.
#

POS_MODEL = {"w": sciflat.Positive(1.0), "b": jnp.asarray(0.0)}
POS_RESIDUALS = lambda m: jnp.stack([m["w"] - 2.0, m["b"]])


@pytest.mark.parametrize(
    "bounds",
    [
        {"['w']": (0.0, 5.0)},
        {"w": (0.0, 5.0)},
        {lambda m: m["w"]: (0.0, 5.0)},
        ({"w": 0.0, "b": None}, {"w": 5.0, "b": None}),
    ],
    ids=["path", "bare key", "lambda", "pytrees"],
)
@pytest.mark.parametrize("name", ["least_squares", "minimize"])
def test_bounds_on_a_transformed_leaf_name_the_transform(name, bounds):
    f = (
        POS_RESIDUALS
        if name == "least_squares"
        else lambda m: jnp.sum(POS_RESIDUALS(m) ** 2)
    )
    with pytest.raises(ValueError) as info:
        getattr(sciflat, name)(f, POS_MODEL, bounds=bounds, progress=False)
    text = str(info.value)
    assert "`['w']` is a `sciflat.Positive`" in text, text
    assert "would bound the unconstrained `raw`" in text and "sciflat.Interval" in text
    assert "\\'" not in text  # no nested repr


def test_bounds_for_an_unknown_leaf_quote_paths_once():
    with pytest.raises(ValueError) as info:
        sciflat.least_squares(
            POS_RESIDUALS, POS_MODEL, bounds={"zz": (0, 1)}, progress=False
        )
    text = str(info.value)
    assert "`zz` does not pick a trainable leaf" in text and "\\'" not in text, text
    assert "`['b']`, `['w'].raw`" in text, text


def test_bounds_on_raw_itself_are_taken_as_asked():
    res = sciflat.least_squares(
        POS_RESIDUALS, POS_MODEL, bounds={"['w'].raw": (None, 1.0)}, progress=False
    )
    # The bound is on raw: softplus(1.0) = 1.3133 is the closest to 2 it allows.
    np.testing.assert_allclose(sciflat.unwrap(res.model)["w"], jax.nn.softplus(1.0))


def test_model_shaped_bounds_may_leave_a_transformed_leaf_unbounded():
    lower, upper = {"w": None, "b": -1.0}, {"w": None, "b": 1.0}
    res = sciflat.least_squares(
        lambda m: jnp.stack([m["w"] - 2.0, m["b"] - 3.0]),
        POS_MODEL,
        bounds=(lower, upper),
        progress=False,
    )
    np.testing.assert_allclose(sciflat.unwrap(res.model)["w"], 2.0)
    np.testing.assert_allclose(res.model["b"], 1.0)  # at its bound


LINE_X = np.linspace(0.0, 1.0, 5)
LINE_Y = 2.0 * LINE_X + 1.0
LINE_START = {"a": 1.0, "b": 0.5}
line_residuals = lambda m, x, y: m["a"] + m["b"] * x - y


def test_complex_residuals_or_loss_must_be_real():
    complex_residuals = lambda m, x, y: line_residuals(m, x, y) * (1 + 0j)
    with pytest.raises(TypeError) as info:
        sciflat.least_squares(
            complex_residuals, LINE_START, args=(LINE_X, LINE_Y), progress=False
        )
    text = str(info.value)
    assert "The residuals must be real: expected float64, got complex128" in text
    assert "r.real, r.imag" in text and "casts" not in text, text
    complex_loss = lambda m, x, y: jnp.sum(complex_residuals(m, x, y) ** 2)
    with pytest.raises(TypeError, match="The loss must be real: expected float64"):
        sciflat.minimize(
            complex_loss, LINE_START, args=(LINE_X, LINE_Y), progress=False
        )


def test_float32_residuals_still_point_to_the_cast():
    cast = lambda m, x, y: line_residuals(m, x, y).astype(jnp.float32)
    with pytest.raises(TypeError, match="audit_dtypes"):
        sciflat.least_squares(cast, LINE_START, args=(LINE_X, LINE_Y), progress=False)


def test_pytree_residuals_say_what_is_expected():
    as_dict = lambda m, x, y: {"r": line_residuals(m, x, y)}
    with pytest.raises(TypeError) as info:
        sciflat.least_squares(
            as_dict, LINE_START, args=(LINE_X, LINE_Y), progress=False
        )
    text = str(info.value)
    assert "`residuals` must return an array" in text and "got dict" in text, text
    assert "ravel_pytree" in text and "requires ndarray" not in text, text


@pytest.mark.parametrize("method", ["auto", "trf", "lm"])
def test_nan_in_the_data_names_the_args_entry_and_indices(method):
    y = LINE_Y.copy()
    y[[1, 3]] = np.nan
    res = sciflat.least_squares(
        line_residuals, LINE_START, args=(LINE_X, y), method=method, progress=False
    )
    assert res.status == "nonfinite"
    text = res.message
    assert "at the start" in text and "residuals [1, 3]" in text, text
    assert "`args[1]` is non-finite at [1, 3]" in text, text
    assert "stepped" not in text and "best finite point" not in text, text
    assert res.n_evaluations == 1 and "function evals:      1" in str(res)
    np.testing.assert_array_equal(res.p, [1.0, 0.5])  # the start, untouched


def test_nan_in_the_data_of_minimize_names_the_args_entry():
    x = LINE_X.copy()
    x[2] = np.inf
    loss = lambda m, x, y: jnp.sum(line_residuals(m, x, y) ** 2)
    res = sciflat.minimize(loss, LINE_START, args=(x, LINE_Y), progress=False)
    assert res.status == "nonfinite"
    assert (
        "at the start" in res.message
        and "`args[0]` is non-finite at [2]" in res.message
    )
    assert "best finite point" not in res.message, res.message


def test_a_start_nonfinite_without_bad_data_says_so():
    # The data are finite; the model is not at the start (log of a negative number).
    bad = lambda m, x, y: jnp.log(m["b"] - 1.0) * x - y
    res = sciflat.least_squares(bad, LINE_START, args=(LINE_X, LINE_Y), progress=False)
    assert (
        "at the start" in res.message and "the data in `args` are finite" in res.message
    )


@pytest.mark.parametrize("fit_name", ["least_squares", "minimize"])
def test_an_untied_start_for_a_tied_model_names_the_tie(fit_name):
    w = jnp.asarray([1.0, 2.0])
    tied = {"a": w, "b": w, "c": jnp.asarray(0.5)}  # `b` is `a`: one array in `p`
    untied = {"a": jnp.asarray([1.0, 2.0]), "b": jnp.asarray([3.0, 4.0]), "c": 0.5}
    res = lambda m: jnp.concatenate([m["a"] - 1.0, m["b"] - 2.0, m["c"][None]])
    f = res if fit_name == "least_squares" else lambda m: jnp.sum(res(m) ** 2)
    with pytest.raises(ValueError) as info:
        sciflat.multistart(
            getattr(sciflat, fit_name), f, tied, [tied, untied], progress=False
        )
    text = str(info.value)
    assert "`starts[1]` does not have the model's ties" in text, text
    assert "`['b']` is tied to `['a']`" in text and "same shape" not in text, text


_FLOAT64_FITS = {
    "minimize": lambda r, model, **kw: sciflat.minimize(
        lambda m, *a: jnp.sum(r(m, *a) ** 2), model, progress=False, **kw
    ),
    "least_squares": lambda r, model, **kw: sciflat.least_squares(
        r, model, progress=False, **kw
    ),
    "device": lambda r, model, **kw: sciflat.least_squares(
        r, model, method="device", **kw
    ),
    "least_squares_batch": lambda r, model, **kw: sciflat.least_squares_batch(
        r, model, progress=False, **kw
    ),
}


class _Rate(eqx.Module):
    rate: float  # a Python float in a module: static, so nothing to fit


@pytest.mark.parametrize("name", list(_FLOAT64_FITS))
def test_every_float64_fit_checks_its_inputs_in_one_order(name):
    run = _FLOAT64_FITS[name]
    who = "least_squares" if name == "device" else name
    residuals = lambda m, *a: jnp.ravel(jax.tree.leaves(m)[0]) - 1.0
    good = {"w": jnp.asarray([1.0, 2.0])}
    with pytest.raises(TypeError, match=rf"`{who}`: `args` must be a tuple.*ndarray"):
        run(residuals, good, args=np.ones(2))
    with pytest.raises(ValueError, match=rf"`{who}`: the model has no floating arr"):
        run(residuals, _Rate(1.0))
    with pytest.raises(ValueError, match=rf"`{who}`: the starting point is not fin"):
        run(residuals, {"w": jnp.asarray([1.0, jnp.nan])})
    # Two wrong inputs: `args` is checked first, by every fit.
    with pytest.raises(TypeError, match=rf"`{who}`: `args` must be a tuple"):
        run(residuals, _Rate(1.0), args=np.ones(2))


@pytest.mark.parametrize("method", ["lm", "device"])
def test_minpack_options_are_checked_alike_on_the_host_and_the_device(method):
    # Both run MINPACK's Levenberg–Marquardt from one record of its options.
    fit = lambda **kw: sciflat.least_squares(
        lambda m: m["w"] - 1.0,
        {"w": jnp.asarray([1.0, 2.0])},
        method=method,
        progress=False,
        **kw,
    )
    with pytest.raises(ValueError, match=r"`least_squares`: `ftol`, `xtol`, `gtol` mu"):
        fit(ftol=-1.0)
    with pytest.raises(ValueError, match=r"`x_scale` must be 'jac' or positive"):
        fit(x_scale=np.array([1.0, 0.0]))


def _starts_of(who: str):
    """`starts` handed to `multistart` or `least_squares_batch`, with the data."""
    res = lambda m: jnp.concatenate([jnp.ravel(m["a"]) - 1.0, jnp.ravel(m["b"])])
    if who == "multistart":
        return lambda model, starts: sciflat.multistart(
            sciflat.least_squares, res, model, starts, progress=False
        )
    return lambda model, starts: sciflat.least_squares_batch(
        res, model, starts=starts, progress=False
    )


@pytest.mark.parametrize("who", ["multistart", "least_squares_batch"])
def test_starts_are_checked_alike_by_every_fit_that_takes_them(who):
    fit = _starts_of(who)
    model = {"a": jnp.asarray([1.0, 2.0]), "b": jnp.asarray(0.5)}
    cases = [
        # A model of other leaves: which start, and both sets of leaves.
        (
            [model, {"a": jnp.asarray([1.0, 2.0])}],
            ValueError,
            (
                rf"`{who}`: the starts differ in structure: `starts\[1\]` does not "
                r"have the model's trainable leaves: expected "
                r"\[\"\['a'\]\", \"\['b'\]\"\] \(3 numbers\), got \[\"\['a'\]\"\] \(2\)"
            ),
        ),
        # Rows of another length, or one vector for one start.
        (
            np.ones((2, 4)),
            ValueError,
            rf"`{who}`: `starts` as an array must have shape \(K, 3\).*got \(2, 4\)",
        ),
        (np.ones(3), ValueError, r"shape \(K, 3\).*got \(3,\)"),
        # Integer rows are not cast silently.
        (
            np.ones((2, 3), np.int64),
            TypeError,
            rf"`{who}` \(`starts`\) expected a real floating vector, got dtype int64",
        ),
        ([], ValueError, rf"`{who}`: `starts` is empty; give at least one start"),
    ]
    for starts, error, message in cases:
        with pytest.raises(error, match=message):
            fit(model, starts)
    w = jnp.asarray([1.0, 2.0])
    tied = {"a": w, "b": w}  # one array: 2 entries of `p`, not 4
    untied = {"a": jnp.asarray([1.0, 2.0]), "b": jnp.asarray([3.0, 4.0])}
    with pytest.raises(ValueError) as info:
        fit(tied, [tied, untied])
    text = str(info.value)
    assert f"`{who}`: the starts differ in structure: `starts[1]` does not " in text
    assert "have the model's ties: in the model `['b']` is tied to `['a']`" in text
    assert "rows of length 2 in the order of `p`" in text, text


@pytest.mark.parametrize("flag", ["model", "p"])
def test_vector_field_old_args_flag_names_the_fix(flag):
    _, re = sciflat.destructure({"w": jnp.asarray(1.0)})
    with pytest.raises(TypeError) as info:
        sciflat.vector_field(re, args=flag)  # pyright: ignore[reportCallIssue]
    text = str(info.value)
    assert "no longer takes `args=`" in text and "sciflat.vector_field(re)" in text
    assert "unexpected keyword" not in text, text


def test_fit_with_data_after_the_optimiser_names_args():
    import optax

    loss = lambda m, x, y: jnp.sum((m["w"] * x - y) ** 2)
    with pytest.raises(TypeError) as info:
        sciflat.fit(loss, {"w": 1.0}, optax.adam(0.1), LINE_X, LINE_Y)  # pyright: ignore[reportCallIssue]
    text = str(info.value)
    assert "got 2 positional arguments after `optimizer`" in text, text
    assert "sciflat.fit(loss, model, optimizer, args=(x, y), ...)" in text, text
    # The SciPy fits, by the same check.
    with pytest.raises(TypeError, match=r"after `model`: write `sciflat.minimize\("):
        sciflat.minimize(loss, {"w": 1.0}, LINE_X, LINE_Y)  # pyright: ignore[reportCallIssue]
