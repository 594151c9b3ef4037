"""`sciflat.petab_problem`: the PEtab reader, each piece against a hand-derived ODE or a
closed form, and the Boehm et al. 2014 benchmark against AMICI's log-likelihood."""

import collections
import math
import pathlib
import re

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import sciflat


libsbml = pytest.importorskip("libsbml")  # the `petab` extra (in `test`): always there

BOEHM = sciflat.petab_benchmark("Boehm_JProteomeRes2014")  # ships with sciflat
# AMICI with SUNDIALS (AMICI's tests/benchmark_models/benchmark_models.yaml).
BOEHM_LLH = -138.22199693517703


#
# Writing small problems by hand: SBML through libsbml, the tables as TSV.
#


def write_sbml(
    path,
    *,
    compartments=(("c1", 1.0),),
    species=(),
    parameters=(),
    reactions=(),
    rules=(),
    initial=(),
    rate_rules=(),
    events=False,
):
    """species: (id, compartment, initial concentration or None, hasOnlySubstanceUnits,
    initial amount or None); parameters: (id, value, constant); reactions: (id,
    reactants {id: stoich}, products, law); rules: (variable, formula)."""
    doc = libsbml.SBMLDocument(3, 2)
    m = doc.createModel()
    m.setId("hand_written")
    for cid, size in compartments:
        c = m.createCompartment()
        c.setId(cid), c.setSize(size), c.setConstant(True), c.setSpatialDimensions(3)
    for sid, comp, conc, only_amounts, amount in species:
        s = m.createSpecies()
        s.setId(sid), s.setCompartment(comp), s.setConstant(False)
        s.setBoundaryCondition(False), s.setHasOnlySubstanceUnits(only_amounts)
        if conc is not None:
            s.setInitialConcentration(conc)
        if amount is not None:
            s.setInitialAmount(amount)
    for pid, value, constant in parameters:
        p = m.createParameter()
        p.setId(pid), p.setValue(value), p.setConstant(constant)
    for variable, formula in rules:
        r = m.createAssignmentRule()
        r.setVariable(variable), r.setMath(libsbml.parseL3Formula(formula))
    for variable, formula in rate_rules:
        r = m.createRateRule()
        r.setVariable(variable), r.setMath(libsbml.parseL3Formula(formula))
    for symbol, formula in initial:
        a = m.createInitialAssignment()
        a.setSymbol(symbol), a.setMath(libsbml.parseL3Formula(formula))
    for rid, reactants, products, law in reactions:
        r = m.createReaction()
        r.setId(rid), r.setReversible(False)
        for sid, n in reactants.items():
            ref = r.createReactant()
            ref.setSpecies(sid), ref.setStoichiometry(n), ref.setConstant(True)
        for sid, n in products.items():
            ref = r.createProduct()
            ref.setSpecies(sid), ref.setStoichiometry(n), ref.setConstant(True)
        r.createKineticLaw().setMath(libsbml.parseL3Formula(law))
    if events:
        e = m.createEvent()
        e.setId("dose"), e.setUseValuesFromTriggerTime(True)
        trigger = e.createTrigger()
        trigger.setMath(libsbml.parseL3Formula("time > 1"))
        trigger.setInitialValue(False), trigger.setPersistent(True)
        a = e.createEventAssignment()
        a.setVariable(species[0][0]), a.setMath(libsbml.parseL3Formula("1"))
    assert libsbml.writeSBMLToFile(doc, str(path))


def write_tsv(path, header, rows):
    lines = ["\t".join(header)] + ["\t".join(map(str, r)) for r in rows]
    path.write_text("\n".join(lines) + "\n")


def write_problem(folder, *, table, conditions, observables, measurements, **sbml):
    folder.mkdir(parents=True, exist_ok=True)
    write_sbml(folder / "model.xml", **sbml)
    write_tsv(
        folder / "parameters.tsv",
        [
            "parameterId",
            "parameterScale",
            "lowerBound",
            "upperBound",
            "nominalValue",
            "estimate",
            "objectivePriorType",
            "objectivePriorParameters",
        ],
        [(*row, "", "")[:8] for row in table],  # rows of 6, or 8 with a prior
    )
    cond_header = ["conditionId", *sorted({k for c in conditions.values() for k in c})]
    write_tsv(
        folder / "conditions.tsv",
        cond_header,
        [
            [cid, *(c.get(k, "") for k in cond_header[1:])]
            for cid, c in conditions.items()
        ],
    )
    write_tsv(
        folder / "observables.tsv",
        [
            "observableId",
            "observableFormula",
            "noiseFormula",
            "observableTransformation",
            "noiseDistribution",
        ],
        observables,
    )
    write_tsv(
        folder / "measurements.tsv",
        [
            "observableId",
            "preequilibrationConditionId",
            "simulationConditionId",
            "measurement",
            "time",
            "observableParameters",
            "noiseParameters",
        ],
        measurements,
    )
    (folder / "problem.yaml").write_text(
        "format_version: 1\nparameter_file: parameters.tsv\nproblems:\n"
        "- condition_files: [conditions.tsv]\n  measurement_files: [measurements.tsv]\n"
        "  observable_files: [observables.tsv]\n  sbml_files: [model.xml]\n"
    )
    return folder / "problem.yaml"


#
# One small problem with every supported piece, compiled once for the module.
#
# A -> B with mass action k A (an amount per time) in compartment c1 of size 2, A and B
# in concentrations: dA/dt = -k A / 2, so A = A0 exp(-k t / 2), B = A0 - A. A0 = 3 a0
# (an initial assignment), a0 set per condition (1 and 2). C, in amounts, decays with
# kk C where kk = 2 k (an assignment rule): C = 5 exp(-2 k t). k is estimated on the
# log10 scale, `scale` (the observable parameter of obsA) linearly, `sd` (obsA's noise
# parameter) on the natural-log scale.

K, SCALE, SD, SD_B = 0.3, 1.7, 0.2, 0.15
# The solver of the tests of the tables and the noise model, where the default's
# probe of an explicit method (`BDF`'s `explicit_first`) would only cost time.
BDF_ALONE = sciflat.BDF(explicit_first=False)
SMALL_MEASUREMENTS = [
    # observable, condition, measurement, time, observableParameters, noiseParameters
    ("obsA", "low", 5.3, 0.0, "scale", "sd"),
    ("obsA", "low", 4.1, 1.0, "scale", "sd"),
    ("obsA", "low", 3.3, 2.5, "scale", "sd"),
    ("obsA", "high", 9.0, 0.5, "scale", "sd"),
    ("obsA", "high", 4.4, 4.0, "scale", "sd"),
    ("obsC", "low", 2.9, 1.0, "", ""),
    ("obsC", "low", 1.6, 2.0, "", ""),
    ("obsB", "high", 0.9, 1.0, "", ""),
    ("obsB", "high", 3.2, 4.0, "", ""),
    ("obsD", "low", 0.5, 1.0, "", ""),
    ("obsD", "high", 3.0, 2.0, "", ""),
]


SMALL_OBSERVABLES = [
    ("obsA", "observableParameter1_obsA * A", "noiseParameter1_obsA", "lin", "normal"),
    ("obsC", "C", "0.1", "lin", "laplace"),
    ("obsB", "B", "sdB", "log10", "normal"),
    # names a0, a constant of the model set per condition
    ("obsD", "a0 * B", "0.5", "lin", "normal"),
]


def small_problem(folder, measurements=SMALL_MEASUREMENTS, **changes):
    spec = dict(
        compartments=(("c1", 2.0),),
        species=(
            ("A", "c1", None, False, None),
            ("B", "c1", 0.0, False, None),
            ("C", "c1", None, True, 5.0),
        ),
        parameters=(("k", 1.0, True), ("a0", 1.0, True), ("kk", 0.0, False)),
        rules=(("kk", "2 * k"),),
        initial=(("A", "3 * a0"),),
        reactions=(
            ("R1", {"A": 1}, {"B": 1}, "k * A"),
            ("R2", {"C": 1}, {}, "kk * C"),
        ),
        parameters_table=[
            ("k", "log10", 1e-3, 1e3, K, 1),
            ("scale", "lin", 0.1, 10, SCALE, 1),
            ("sd", "log", 1e-3, 10, SD, 1),
            ("sdB", "lin", 0, 1, SD_B, 0),
        ],
        conditions={"low": {"a0": 1.0}, "high": {"a0": 2.0}},
        observables=SMALL_OBSERVABLES,
    )
    spec.update(changes)
    rows = [(o, "", c, y, t, op, npar) for o, c, y, t, op, npar in measurements]
    return write_problem(
        folder,
        table=spec.pop("parameters_table"),
        conditions=spec.pop("conditions"),
        observables=spec.pop("observables"),
        measurements=rows,
        **spec,
    )


def closed_form(k, a0, t, xp=np):
    a = 3 * a0 * xp.exp(-k * t / 2)
    return {"A": a, "B": 3 * a0 - a, "C": 5 * xp.exp(-2 * k * t)}


# Each condition's a0 (`again` sets the same number as `low`: one simulation).
A0 = {"low": 1.0, "high": 2.0, "again": 1.0}


def small_nll(
    k=K, scale=SCALE, sd=SD, measurements=SMALL_MEASUREMENTS, sd_a=None, xp=np
):
    """The PEtab negative log-likelihood of the small problem, by hand (obsA's σ is
    `sd`, or `sd_a(sd, scale)`); `xp=jnp` for one JAX can differentiate."""
    total = 0.0
    sd = sd if sd_a is None else sd_a(sd, scale)
    for obs, cond, y, t, _, _ in measurements:
        a0 = A0[cond]
        x = closed_form(k, a0, t, xp)
        if obs == "obsA":  # normal, linear
            h = scale * x["A"]
            total += 0.5 * xp.log(2 * math.pi * sd**2) + 0.5 * ((y - h) / sd) ** 2
        elif obs == "obsD":  # normal, linear, sigma 0.5, each condition's a0
            r = (y - a0 * x["B"]) / 0.5
            total += 0.5 * math.log(2 * math.pi * 0.5**2) + 0.5 * r**2
        elif obs == "obsC":  # Laplace, linear, sigma 0.1
            total += math.log(2 * 0.1) + xp.abs(y - x["C"]) / 0.1
        else:  # normal on the log10 scale
            r = (math.log10(y) - xp.log10(x["B"])) / SD_B
            total += 0.5 * math.log(2 * math.pi * SD_B**2 * (y * math.log(10)) ** 2)
            total += 0.5 * r**2
    return total


def small_nll_of_p(x, measurements=SMALL_MEASUREMENTS):
    """`small_nll` of the flat vector of `(k, scale, sd)` on their scales in the table
    (log10, linear, natural log), in JAX: the closed form to differentiate."""
    return small_nll(10 ** x[0], x[1], jnp.exp(x[2]), measurements, xp=jnp)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = small_problem(tmp_path_factory.mktemp("petab") / "small")
    # Solved to 1e-11 (BDF, the default: its global error about 10 rtol) for the
    # comparisons with the closed form at 1e-9.
    return sciflat.petab_problem(path, rtol=1e-11, atol=1e-13)


@pytest.mark.slow  # reads SBML with SymPy and compiles Diffrax solves: seconds
def test_small_reads_the_scales_bounds_and_nominal_values(small):
    assert small.parameter_ids == ("k", "scale", "sd")
    assert small.scales == {"k": "log10", "scale": "lin", "sd": "log"}
    np.testing.assert_allclose(float(small.nominal["k"]), math.log10(K))
    np.testing.assert_allclose(float(small.nominal["sd"]), math.log(SD))
    lower, upper = small.bounds
    np.testing.assert_allclose([lower["k"], upper["k"]], [-3.0, 3.0])
    np.testing.assert_allclose([lower["sd"], upper["sd"]], np.log([1e-3, 10.0]))
    assert (lower["scale"], upper["scale"]) == (0.1, 10.0)
    linear = small.unscale(small.nominal)
    np.testing.assert_allclose(
        [float(linear[k]) for k in "k scale sd".split()], [K, SCALE, SD]
    )


@pytest.mark.slow  # reads SBML with SymPy and compiles Diffrax solves: seconds
def test_small_ode_divides_by_the_compartment_size_of_concentrations(small):
    # The symbolic right-hand side, as derived by hand (no solve).
    import sympy

    A, C, k, c1 = sympy.symbols("A C k c1", real=True)
    assert small.species == ("A", "B", "C")
    rhs = small.ode.rhs
    assert sympy.simplify(rhs[0] - (-k * A / c1)) == 0  # concentration: / size
    assert sympy.simplify(rhs[1] - k * A / c1) == 0
    assert sympy.simplify(rhs[2] - (-2 * k * C)) == 0  # amount, rule kk = 2 k
    a0 = sympy.Symbol("a0", real=True)
    assert sympy.simplify(small.ode.x0[0] - 3 * a0) == 0  # initial assignment


@pytest.mark.slow  # reads SBML with SymPy and compiles Diffrax solves: seconds
@pytest.mark.parametrize(("condition", "a0"), [("low", 1.0), ("high", 2.0)])
def test_small_simulates_the_closed_form_in_each_condition(small, condition, a0):
    times = np.linspace(0.0, 4.0, 9)
    out = small.simulate(small.nominal, times, condition)
    want = closed_form(K, a0, times)
    state = np.asarray(out["state"])
    for i, s in enumerate(small.species):
        np.testing.assert_allclose(state[:, i], want[s], rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(out["obsA"], SCALE * want["A"], rtol=1e-8)


@pytest.mark.slow  # reads SBML with SymPy and compiles Diffrax solves: seconds
def test_small_nll_is_the_petab_formula(small):
    # normal with placeholders, Laplace, normal on a log10 scale; three scales.
    np.testing.assert_allclose(float(small.nll(small.nominal)), small_nll(), rtol=1e-9)
    other = {"k": jnp.asarray(-0.2), "scale": jnp.asarray(2.1), "sd": jnp.asarray(-1.0)}
    want = small_nll(k=10**-0.2, scale=2.1, sd=math.exp(-1.0))
    np.testing.assert_allclose(float(small.nll(other)), want, rtol=1e-9)
    np.testing.assert_allclose(float(small.llh(other)), -want, rtol=1e-9)


@pytest.mark.slow  # traces the small problem's nll again: seconds
def test_an_observables_formulas_are_traced_once_for_all_its_conditions(small):
    # obsA and obsD are measured in both conditions: one trace of each formula for
    # both (the rows batched), not one per condition; the values are checked against
    # the closed form in `test_small_nll_is_the_petab_formula`.
    formulas = small._objective.formulas
    calls = collections.Counter()

    def counting(name, fn):
        def traced(*args):
            calls[name] += 1
            return fn(*args)

        return traced

    ids = small.observable_ids
    saved = [(f, f.fn) for f in (*formulas.h, *formulas.sigma)]
    try:
        for i, oid in enumerate(ids):
            formulas.h[i].fn = counting(("h", oid), formulas.h[i].fn)
            formulas.sigma[i].fn = counting(("sigma", oid), formulas.sigma[i].fn)
        jax.make_jaxpr(lambda m: small._objective.nll(m))(small.nominal)
    finally:
        for f, fn in saved:
            f.fn = fn
    assert calls == {(kind, oid): 1 for kind in ("h", "sigma") for oid in ids}


@pytest.mark.slow  # reads SBML with SymPy and compiles Diffrax solves: seconds
def test_observables_sharing_a_formula_trace_it_once(tmp_path):
    # obsA2 is obsA under another id, its placeholders its own, measured as obsA:
    # one formula object for both, traced once for all their rows, and the nll the
    # closed form's with obsA's rows counted twice.
    obs_a = [m for m in SMALL_MEASUREMENTS if m[0] == "obsA"]
    rows = SMALL_MEASUREMENTS + [("obsA2", *m[1:]) for m in obs_a]
    same = ("obsA2", "A * observableParameter1_obsA2", "noiseParameter1_obsA2")
    observables = [
        SMALL_OBSERVABLES[0],
        (*same, "lin", "normal"),
        *SMALL_OBSERVABLES[1:],
    ]
    path = small_problem(tmp_path, rows, observables=observables)
    problem = sciflat.petab_problem(path, rtol=1e-11, atol=1e-13)
    formulas = problem._objective.formulas
    ids = problem.observable_ids
    a, a2 = ids.index("obsA"), ids.index("obsA2")
    assert formulas.h[a] is formulas.h[a2] and formulas.sigma[a] is formulas.sigma[a2]
    calls = collections.Counter()
    shared = formulas.h[a]
    saved = shared.fn

    def counting(*args):
        calls["h"] += 1
        return saved(*args)

    shared.fn = counting
    try:
        jax.make_jaxpr(lambda m: problem._objective.nll(m))(problem.nominal)
    finally:
        shared.fn = saved
    assert calls["h"] == 1
    want = small_nll() + small_nll(measurements=obs_a)
    np.testing.assert_allclose(float(problem.nll(problem.nominal)), want, rtol=1e-9)


@pytest.mark.slow  # reads SBML with SymPy and compiles Diffrax solves: seconds
def test_small_residuals_refuse_laplace_noise(small):
    with pytest.raises(ValueError, match=r"normal noise only.*minimize"):
        small.residuals(small.nominal)


@pytest.mark.slow  # reads SBML with SymPy and compiles Diffrax solves: seconds
def test_small_nll_and_its_forward_derivative_are_float64_throughout(small):
    # The solves' derivatives are forward-mode (diffrax.ForwardMode): audited as such.
    for fn in (small.nll, jax.jacfwd(small.nll)):
        report = sciflat.audit_dtypes(fn, small.nominal, grad=False)
        assert not report.findings, str(report)


@pytest.mark.slow  # compiles the gradients through the solves: seconds
def test_small_gradient_matches_finite_differences_in_both_modes(small):
    # Reverse mode through the solves (Diffrax's forward mode is a while loop JAX
    # cannot transpose) is the transpose of their forward sensitivities.
    p, re = sciflat.destructure(small.nominal, dtype=jnp.float64)
    f = lambda x: small.nll(re(x))
    # (with the value forward mode computes beside it)
    grad, forward_value = jax.jacfwd(lambda x: (y := f(x), y), has_aux=True)(p)
    h = 1e-6
    fd = [(f(p.at[i].add(h)) - f(p.at[i].add(-h))) / (2 * h) for i in range(len(p))]
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-6)
    value, reverse = jax.value_and_grad(f)(p)
    np.testing.assert_allclose(reverse, grad, rtol=1e-12)
    # The value that comes with a derivative is that of the solves whose steps
    # control the sensitivities' errors too (BDF's `control_sensitivities`): the
    # same in every mode, and `nll`'s within the solves' tolerances (1e-11 here).
    np.testing.assert_allclose(value, forward_value, rtol=1e-14)
    np.testing.assert_allclose(value, f(p), rtol=1e-9)


@pytest.mark.slow  # traces the small problem's value and gradient: seconds
def test_the_default_solves_hold_no_host_callbacks(small):
    # JAX's persistent compilation cache stores no program that holds a host
    # callback, so a later process compiles such a program again (docs/petab.md,
    # "Between processes"). The default solves are sciflat's own loops, without
    # Equinox's runtime checks (callbacks, where Diffrax's solves hold them). The
    # callbacks are in the lowered program, which is what JAX's cache looks at.
    import equinox as eqx

    p, rebuild = sciflat.destructure(small.nominal, dtype=jnp.float64)
    f = lambda x: small.nll(rebuild(x))

    def callbacks(fn) -> list[str]:  # the callback custom calls of `fn`'s program
        targets = re.findall(r"custom_call @([\w.]+)", jax.jit(fn).lower(p).as_text())
        return [t for t in targets if "callback" in t]

    assert callbacks(f) == callbacks(jax.value_and_grad(f)) == []
    # (what the test looks for: a program with a runtime check holds one)
    assert callbacks(lambda x: eqx.error_if(x, x[0] > 1e300, "too large"))


@pytest.fixture(scope="module")
def adjoint_small(tmp_path_factory):
    """The small problem with a noise parameter, its `nll` differentiated by the
    adjoint of the steps (`BDF(adjoint=True)`, the sensitivities' errors not
    controlled): `(path, problem, p, re, (value, gradient))`, the gradient compiled
    once for the tests that compare other ways with it. That gradient's program
    keeps the rows of 8 attempts at a time (its solves take dozens: the adjoint runs
    the earlier segments again from their starts) and takes one condition at a
    time; the problem's own programs, compiled later, are the defaults. (The values
    by `BDF` too, `explicit_first=False`: the derivatives are its whichever method
    solves them, and the explicit method's tests are test_petab_explicit.py's.)"""
    from sciflat._petab import bdf, objective

    folder = tmp_path_factory.mktemp("adjoint") / "small"
    path = small_problem(folder, measurements=NORMAL_MEASUREMENTS)
    solver = sciflat.BDF(
        control_sensitivities=False, adjoint=True, explicit_first=False
    )
    problem = sciflat.petab_problem(path, rtol=1e-9, atol=1e-11, solver=solver)
    p, re = sciflat.destructure(problem.nominal, dtype=jnp.float64)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bdf, "_SEGMENT", 8)
        patch.setattr(objective, "ADJOINT_CHUNK_ENTRIES", 1)
        want = jax.jit(jax.value_and_grad(lambda x: problem.nll(re(x))))(p)
    return path, problem, p, re, want


@pytest.mark.slow  # compiles the small problem's solves three ways: seconds
def test_the_adjoint_gradient_is_the_forward_gradient_along_the_same_steps(
    adjoint_small,
):
    # `BDF(adjoint=True)`: `jax.grad` of `nll` by the adjoint of the steps (the
    # default beyond 100 parameters read) against forward mode along the same steps
    # (`adjoint=False`), on a problem of two conditions with an initial state and a
    # noise parameter estimated; `residuals` keep their forward mode, `nll` has none.
    # The adjoint's program (the fixture's) runs its solves again in segments (80
    # and 110 attempts here, 8 a segment), a condition at a time: the same steps.
    path, adjoint, p, re, by_adjoint = adjoint_small
    forward = sciflat.petab_problem(
        path,
        rtol=1e-9,
        atol=1e-11,
        solver=sciflat.BDF(
            control_sensitivities=False, adjoint=False, explicit_first=False
        ),
    )
    problems = {True: adjoint, False: forward}
    forward_vg = jax.jit(jax.value_and_grad(lambda x: forward.nll(re(x))))
    got = {True: by_adjoint, False: forward_vg(p)}
    assert float(got[True][0]) == float(got[False][0])
    np.testing.assert_allclose(got[True][1], got[False][1], rtol=1e-10, atol=1e-12)
    assert float(jnp.max(jnp.abs(got[True][1]))) > 1  # a gradient, not zeros
    jacobians = [
        jax.jacfwd(lambda x, pr=pr: pr.residuals(re(x)))(p) for pr in problems.values()
    ]
    np.testing.assert_array_equal(*jacobians)
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda x: problems[True].nll(re(x)), (p,), (p,))
    # A fit takes the adjoint's gradient (SciPy's path tries forward mode first for
    # few parameters) and ends where forward mode's gradient vanishes: 3e-7 of the
    # start's (a fit by forward mode ends at the same point, to 1e-8). Its
    # `uncertainty` differentiates `nll`'s forward-mode solve whatever `adjoint` says.
    fit = adjoint.uncertainty(
        sciflat.minimize(
            adjoint.nll, adjoint.nominal, bounds=adjoint.bounds, progress=False
        )
    )
    assert "reverse mode" in fit.message
    end = sciflat.destructure(fit.model, dtype=jnp.float64)[0]
    value, grad = forward_vg(end)
    assert float(value) == float(fit.loss)
    assert float(jnp.linalg.norm(grad)) < 1e-6 * float(jnp.linalg.norm(got[False][1]))
    errors = jnp.stack([fit.stderr[k] for k in sorted(fit.stderr)])
    assert bool(jnp.all(jnp.isfinite(errors) & (errors > 0)))
    # Its Hessian (forward mode over the sensitivities, each step's corrector
    # differentiated twice) is the central differences of the gradient along the
    # same steps: 1e-8 here. (With the corrector's matrix held constant in the
    # second derivative, the rate's entry was 0.5 % off here, 10 % at the start.)
    h = 1e-4
    differences = [
        (forward_vg(end.at[i].add(h))[1] - forward_vg(end.at[i].add(-h))[1]) / (2 * h)
        for i in range(len(end))
    ]
    hessian = np.linalg.inv(fit.uncertainty.covariance)
    np.testing.assert_allclose(
        hessian, np.stack(differences, 1), rtol=1e-6, atol=1e-9 * np.abs(hessian).max()
    )


@pytest.mark.slow  # compiles the small problem's gradient and its Jacobian twice
def test_conditions_that_are_one_simulation_are_solved_once(tmp_path, monkeypatch):
    # `again` sets a0 to the number `low` sets (its own measurements of its own):
    # the two are one simulation, solved once, its trajectory read for both. The
    # value and the gradient (the adjoint) are the closed form's, and the residuals'
    # Jacobian (forward sensitivities) that of every condition solved on its own.
    # (The values by `BDF` too: the simulations are the subject, not the method.)
    from sciflat._petab import objective

    measurements = [
        *NORMAL_MEASUREMENTS,
        ("obsA", "again", 4.6, 0.5, "scale", "sd"),
        ("obsA", "again", 2.8, 3.0, "scale", "sd"),
        ("obsD", "again", 0.9, 1.5, "", ""),
    ]
    conditions = {"low": {"a0": 1.0}, "high": {"a0": 2.0}, "again": {"a0": "1"}}
    path = small_problem(tmp_path / "p", measurements, conditions=conditions)
    solver = sciflat.BDF(adjoint=True, explicit_first=False)
    once = sciflat.petab_problem(path, rtol=1e-10, atol=1e-12, solver=solver)
    assert once.conditions == ("low", "high", "again")
    assert once.parameter_ids == ("k", "scale", "sd")
    np.testing.assert_array_equal(once._objective._sims.of, [1, 0, 1])
    every = lambda t: objective.Simulations(
        *[np.arange(3)] * 2, np.full(3, len(t.union_times))
    )
    monkeypatch.setattr(objective, "simulations", every)
    each = sciflat.petab_problem(path, rtol=1e-10, atol=1e-12, solver=solver)
    assert each._objective._sims.distinct
    p, re = sciflat.destructure(once.nominal, dtype=jnp.float64)
    value, grad = jax.jit(jax.value_and_grad(lambda x: once.nll(re(x))))(p)
    closed = lambda x: small_nll_of_p(x, measurements)
    # (7e-14 here; a condition read from the wrong simulation is O(1) off)
    np.testing.assert_allclose(value, closed(p), rtol=1e-12)
    np.testing.assert_allclose(grad, jax.grad(closed)(p), rtol=1e-11)
    assert float(jnp.max(jnp.abs(grad))) > 1
    jacobians = (
        jax.jit(jax.jacfwd(lambda x, pr=pr: pr.residuals(re(x))))(p)
        for pr in (once, each)
    )
    np.testing.assert_allclose(*jacobians, rtol=1e-9, atol=1e-11)


def test_a_number_the_tables_hold_twice_has_one_place(tmp_path):
    # The same number in two rows reads one entry of `ext`; 0.0 and -0.0 are two.
    conditions = {
        "low": {"a0": "1.0"},
        "high": {"a0": "1"},
        "zero": {"a0": "0.0"},
        "minus": {"a0": "-0.0"},
    }
    from sciflat._petab.objective import simulations

    measurements = [
        *NORMAL_MEASUREMENTS,
        ("obsD", "zero", 0.1, 1.0, "", ""),
        ("obsD", "minus", 0.1, 1.0, "", ""),
    ]
    path = small_problem(tmp_path / "p", measurements, conditions=conditions)
    tables = sciflat.petab_problem(path)._objective.tables
    bits = [np.float64(x).tobytes() for x in tables.numbers]
    assert len(set(bits)) == len(bits)
    assert sum(1 for x in tables.numbers if x == 0) == 2
    # low and high are one simulation, to 4.0 (the longest first); zero and minus
    # end at 1.0.
    sims = simulations(tables)
    np.testing.assert_array_equal(sims.first, [0, 2, 3])
    np.testing.assert_array_equal(sims.of, [0, 0, 1, 2])
    times = tables.union_times
    np.testing.assert_array_equal(times[sims.need - 1], [4.0, 1.0, 1.0])


NORMAL_MEASUREMENTS = [m for m in SMALL_MEASUREMENTS if m[0] != "obsC"]
# Normal priors, one on the linear value and one on the parameter's scale: residuals.
NORMAL_PRIORS = [
    ("k", "log10", 1e-3, 1e3, K, 1),
    ("scale", "lin", 0.1, 10, SCALE, 1, "normal", "1.5;0.4"),
    ("sd", "log", 1e-3, 10, SD, 1, "parameterScaleNormal", "-1.2;0.5"),
    ("sdB", "lin", 0, 1, SD_B, 0),
]


@pytest.fixture(scope="module")
def normal(tmp_path_factory):
    """The small problem without the Laplace observable, with two normal priors: it
    has residuals."""
    folder = tmp_path_factory.mktemp("petab") / "normal"
    path = small_problem(folder, NORMAL_MEASUREMENTS, parameters_table=NORMAL_PRIORS)
    # `BDF` alone: the noise model's tests need no choice of method (the default's
    # explicit values are tests/test_petab_explicit.py's).
    return sciflat.petab_problem(path, rtol=1e-10, atol=1e-12, solver=BDF_ALONE)


@pytest.mark.slow  # reads SBML with SymPy and compiles Diffrax solves: seconds
def test_normal_residuals_square_to_the_nll(normal, caplog):
    # Without the Laplace observable: nll == 0.5 * sum(r**2) + residual_offset, the
    # two normal priors included (one residual each).
    problem, rows = normal, NORMAL_MEASUREMENTS
    # Weakly typed values (Python floats, `jnp.asarray(-0.7)`) compute as the
    # nominal float64 ones do: the same compiled `nll` and `residuals`.
    other = {"k": jnp.asarray(-0.7), "scale": 1.2, "sd": jnp.asarray(0.3)}
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        for model in (problem.nominal, other):
            r = problem.residuals(model)
            assert r.shape == (2 * len(rows) + 2,) and r.dtype == jnp.float64
            nll = problem.nll(model)
            assert nll.dtype == jnp.float64
            np.testing.assert_allclose(
                0.5 * float(jnp.sum(r**2)) + problem.residual_offset,
                float(nll),
                rtol=1e-12,
            )
    compiled = [r.getMessage().split(" with ")[0] for r in caplog.records]
    assert compiled.count("Compiling jit(_nll)") == 1, compiled
    assert compiled.count("Compiling jit(_residuals)") == 1, compiled


@pytest.mark.slow  # reads SBML with SymPy and compiles Diffrax solves: seconds
def test_a_noise_formula_may_name_the_observable_parameters(tmp_path):
    # obsA's σ = sd * scale (its noise parameter times its observable parameter).
    rows = [m for m in SMALL_MEASUREMENTS if m[0] == "obsA"]
    noise = "noiseParameter1_obsA * observableParameter1_obsA"
    observables = [("obsA", "observableParameter1_obsA * A", noise, "lin", "normal")]
    table = [
        ("k", "log10", 1e-3, 1e3, K, 1),
        ("scale", "lin", 0.1, 10, SCALE, 1),
        ("sd", "log", 1e-3, 10, SD, 1),
    ]
    path = small_problem(
        tmp_path, rows, observables=observables, parameters_table=table
    )
    problem = sciflat.petab_problem(path, rtol=1e-10, atol=1e-12, solver=BDF_ALONE)
    want = small_nll(measurements=rows, sd_a=lambda sd, scale: sd * scale)
    np.testing.assert_allclose(float(problem.nll(problem.nominal)), want, rtol=1e-9)


@pytest.mark.slow  # compiles the Jacobian through the solves twice: seconds
def test_normal_residuals_jacobian_is_the_same_in_reverse_mode(normal):
    p, re = sciflat.destructure(normal.nominal, dtype=jnp.float64)
    r = lambda x: normal.residuals(re(x))
    forward = jax.jacfwd(r)(p)
    np.testing.assert_allclose(jax.jacrev(r)(p), forward, rtol=1e-12, atol=1e-14)
    h = 1e-6
    fd = [(r(p.at[i].add(h)) - r(p.at[i].add(-h))) / (2 * h) for i in range(len(p))]
    np.testing.assert_allclose(forward, np.stack(fd, axis=1), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # reads SBML with SymPy and compiles Diffrax solves: seconds
def test_starts_are_latin_hypercube_within_the_bounds(small):
    starts = small.sample_starts(10, seed=3)
    x = np.array([[float(s[k]) for k in small.parameter_ids] for s in starts])
    lower, upper = (np.array([b[k] for k in small.parameter_ids]) for b in small.bounds)
    assert ((x >= lower) & (x <= upper)).all()
    # One start in each of the 10 strata of every parameter.
    strata = np.floor((x - lower) / (upper - lower) * 10).astype(int)
    assert all(sorted(col) == list(range(10)) for col in strata.T)
    uniform = small.sample_starts(10, seed=3, method="uniform")
    assert not np.allclose(float(uniform[0]["k"]), x[0, 0])


#
# What the reader refuses, each with a message naming the element.
#


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(events=True), r"events \(dose\)"),
        (
            dict(
                rate_rules=(("a0", "1"),),
                parameters=(("k", 1.0, True), ("a0", 1.0, False), ("kk", 0.0, False)),
            ),
            "rate rule for 'a0'",
        ),
        (
            dict(reactions=(("R1", {"A": 1}, {"B": 1}, "piecewise(k, A > 1, 0) * A"),)),
            "piecewise function in the kinetic law of reaction 'R1'",
        ),
        (
            dict(reactions=(("R1", {"A": 1}, {"B": 1}, "delay(A, 1) * k"),)),
            "delay in the kinetic law of reaction 'R1'",
        ),
        (
            dict(conditions={"low": {"kk": 1.0}, "high": {}}),
            "condition table sets 'kk'.*given by a rule",
        ),
    ],
)
def test_unsupported_sbml_is_a_clear_error(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        sciflat.petab_problem(small_problem(tmp_path, **changes))


def test_preequilibration_is_a_clear_error(tmp_path):
    path = small_problem(tmp_path)
    table = path.parent / "measurements.tsv"
    lines = table.read_text().splitlines()
    lines[1] = lines[1].replace("obsA\t\tlow", "obsA\thigh\tlow")
    table.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        ValueError, match="Measurement 0 has preequilibrationConditionId 'high'"
    ):
        sciflat.petab_problem(path)


def test_wrong_placeholders_are_a_clear_error(tmp_path):
    rows = [("obsA", "low", 5.3, 0.0, "scale;scale", "sd")]
    with pytest.raises(
        ValueError, match=r"Measurement 0 \('obsA'\) gives 2 observableParameters"
    ):
        sciflat.petab_problem(small_problem(tmp_path, rows))


@pytest.mark.slow  # reads SBML with SymPy and compiles Diffrax solves: seconds
def test_a_wrong_model_is_a_clear_error(small):
    with pytest.raises(
        ValueError, match=r"dict of its estimated parameters \['k', 'scale', 'sd'\]"
    ):
        small.nll({"k": 1.0})


#
# The benchmark problem: Boehm et al. 2014, against AMICI.
#


@pytest.fixture(scope="module")
def boehm():
    return sciflat.petab_problem(BOEHM)


@pytest.mark.slow  # reads SBML with SymPy and compiles Diffrax solves: seconds
def test_boehm_reads_nine_log10_parameters(boehm):
    assert len(boehm.parameter_ids) == 9
    assert set(boehm.scales.values()) == {"log10"}
    assert boehm.n_data == 48
    assert boehm.species == (
        "STAT5A",
        "STAT5B",
        "pApB",
        "pApA",
        "pBpB",
        "nucpApA",
        "nucpApB",
        "nucpBpB",
    )


@pytest.mark.slow  # reads SBML with SymPy and compiles Diffrax solves: seconds
def test_boehm_log_likelihood_at_the_published_fit_is_amicis(boehm):
    llh = float(boehm.llh(boehm.nominal))
    np.testing.assert_allclose(llh, BOEHM_LLH, rtol=1e-6)
    r = boehm.residuals(boehm.nominal)
    np.testing.assert_allclose(
        0.5 * float(jnp.sum(r**2)) + boehm.residual_offset, -llh, rtol=1e-12
    )


def test_public_names_are_lazy_and_a_missing_extra_names_it(tmp_path, monkeypatch):
    from sciflat._petab import problem as _petab_problem, sbml as _petab_sbml

    assert sciflat.petab_problem is _petab_problem.petab_problem
    assert sciflat.PetabProblem is _petab_problem.PetabProblem
    assert {"petab_problem", "PetabProblem", "ReactionODE"} <= set(dir(sciflat))
    path = small_problem(tmp_path)
    monkeypatch.setitem(__import__("sys").modules, "libsbml", None)
    with pytest.raises(ImportError, match=r'pip install "sciflat\[petab\]"'):
        _petab_sbml.read_sbml(str(path.parent / "model.xml"))


def test_the_petab_linters_findings_are_clear_errors(tmp_path):
    # A lower bound above the upper one: sciflat's own checks pass it; the `petab`
    # library's linter names it.
    table = [
        ("k", "log10", 1e3, 1e-3, K, 1),
        ("scale", "lin", 0.1, 10, SCALE, 1),
        ("sd", "log", 1e-3, 10, SD, 1),
        ("sdB", "lin", 0, 1, SD_B, 0),
    ]
    with pytest.raises(
        ValueError,
        match=r"not a valid PEtab problem; the PEtab linter .*says:\n"
        r"- lowerBound greater than upperBound for parameterId k\.",
    ):
        sciflat.petab_problem(small_problem(tmp_path, parameters_table=table))


def test_a_table_without_a_required_column_is_a_clear_error(tmp_path):
    path = small_problem(tmp_path)
    table = path.parent / "measurements.tsv"
    lines = table.read_text().replace("\ttime\t", "\tt\t", 1)
    table.write_text(lines)
    with pytest.raises(ValueError, match=r"measurement table has no column \['time'\]"):
        sciflat.petab_problem(path)


#
# Objective priors (PEtab v1), against SciPy's densities.
#

# (type, its parameters, the density of the value SciPy sees): k is on the log10
# scale (linear value 0.3), scale linear (1.7), sd on the natural-log scale (0.2).
PRIOR_CASES = [
    [
        ("k", "logNormal", "-1.0;0.6", stats.lognorm(s=0.6, scale=math.exp(-1.0)), K),
        ("scale", "laplace", "1.5;0.3", stats.laplace(1.5, 0.3), SCALE),
        ("sd", "uniform", "0.1;0.5", stats.uniform(0.1, 0.4), SD),
    ],
    [
        (
            "k",
            "logLaplace",
            "-1.0;0.5",
            stats.loglaplace(c=1 / 0.5, scale=math.exp(-1.0)),
            K,
        ),
        ("scale", "normal", "1.5;0.4", stats.norm(1.5, 0.4), SCALE),
        (
            "sd",
            "parameterScaleLaplace",
            "-1.2;0.5",
            stats.laplace(-1.2, 0.5),
            math.log(SD),
        ),
    ],
    [
        (
            "k",
            "parameterScaleUniform",
            "-2;1",
            stats.uniform(-2.0, 3.0),
            math.log10(K),
        ),
        ("scale", "uniform", "0.1;10", stats.uniform(0.1, 9.9), SCALE),
        (
            "sd",
            "parameterScaleNormal",
            "-1.2;0.5",
            stats.norm(-1.2, 0.5),
            math.log(SD),
        ),
    ],
]


@pytest.mark.parametrize("case", PRIOR_CASES, ids=lambda c: "-".join(r[1] for r in c))
def test_log_prior_is_scipys_density_of_each_prior_type(tmp_path, case):
    scales = {"k": "log10", "scale": "lin", "sd": "log"}
    bounds = {"k": (1e-3, 1e3), "scale": (0.1, 10), "sd": (1e-3, 10)}
    nominal = {"k": K, "scale": SCALE, "sd": SD}
    table = [
        (pid, scales[pid], *bounds[pid], nominal[pid], 1, kind, text)
        for pid, kind, text, _, _ in case
    ] + [("sdB", "lin", 0, 1, SD_B, 0)]
    problem = sciflat.petab_problem(small_problem(tmp_path, parameters_table=table))
    want = sum(float(dist.logpdf(v)) for _, _, _, dist, v in case)
    np.testing.assert_allclose(
        float(problem.log_prior(problem.nominal)), want, rtol=1e-12
    )


def test_a_wrong_prior_is_a_clear_error(tmp_path):
    table = [
        ("k", "log10", 1e-3, 1e3, K, 1, "gamma", "1;2"),
        ("scale", "lin", 0.1, 10, SCALE, 1),
        ("sd", "log", 1e-3, 10, SD, 1),
        ("sdB", "lin", 0, 1, SD_B, 0),
    ]
    with pytest.raises(
        ValueError, match=r"Parameter 'k': `objectivePriorType` must be"
    ):
        sciflat.petab_problem(small_problem(tmp_path, parameters_table=table))


SCHWEN = (
    pathlib.Path(__file__).parent / "data/petab/Schwen_PONE2014/Schwen_PONE2014.yaml"
)
# AMICI's published value (the data's log-likelihood, without the priors).
SCHWEN_LLH = -943.9992988598723


@pytest.mark.slow  # reads SBML with SymPy and compiles Diffrax solves: seconds
def test_schwen_nll_is_amicis_data_llh_and_its_normal_priors():
    # 19 conditions, 30 parameters on the log10 scale, 6 with parameterScaleNormal
    # priors: nll = -(AMICI's llh) - (the priors' log-density by SciPy).
    import csv

    problem = sciflat.petab_problem(SCHWEN)
    with open(SCHWEN.parent / "parameters_Schwen_PONE2014.tsv") as f:
        rows = [r for r in csv.DictReader(f, delimiter="\t") if r["objectivePriorType"]]
    assert len(rows) == 6
    log_prior = 0.0
    for r in rows:
        mean, sd = map(float, r["objectivePriorParameters"].split(";"))
        assert r["objectivePriorType"] == "parameterScaleNormal"
        log_prior += stats.norm(mean, sd).logpdf(
            float(problem.nominal[r["parameterId"]])
        )
    np.testing.assert_allclose(
        float(problem.nll(problem.nominal)), -SCHWEN_LLH - log_prior, rtol=1e-8
    )
    np.testing.assert_allclose(
        float(problem.llh(problem.nominal)), SCHWEN_LLH, rtol=1e-8
    )
    np.testing.assert_allclose(float(problem.log_prior(problem.nominal)), log_prior)


LASKE = (
    pathlib.Path(__file__).parent
    / "data/petab/Laske_PLOSComputBiol2019/Laske_PLOSComputBiol2019.yaml"
)
# AMICI 1.0.1, rtol 1e-12, atol 1e-14 (the data's llh at the nominal parameters).
LASKE_LLH = -315.90591059312095


@pytest.mark.slow  # reads a model of 52 reactions and 29 rules with SymPy: seconds
def test_rate_laws_are_the_symbolic_right_hand_side():
    # The compiled right-hand side (stoichiometry times a vector of rates, the rates
    # computed a template at a time, the 29 assignment rules first) against SymPy's
    # own evaluation of the substituted expressions, at random positive points; `N`
    # applied as padded rows and as sums over its nonzeros (Laske's default: one
    # species is in 22 of the 52 reactions), by a scatter (a batch of conditions)
    # or by short padded rows (one condition); and a batch of conditions at once
    # (`batched`: the scatter with the conditions last), with its derivative.
    import sympy

    from sciflat._petab.formulas import RateLaws
    from sciflat._petab.sbml import read_sbml

    ode = read_sbml(str(LASKE.parent / "model_Laske_PLOSComputBiol2019.xml"))
    auto = RateLaws(sympy, ode)
    assert len(ode.rates) == 52 and len(auto.rates.groups) < 10  # vectorised
    assert auto.sparse_rates and auto.sparse_jacobian
    padded = RateLaws(sympy, ode, sparse=False)
    assert not (padded.sparse_rates or padded.sparse_jacobian)
    alone = RateLaws(sympy, ode, batched=False)
    assert alone._gathers and not auto._gathers
    sym = lambda k: sympy.Symbol(k, real=True)
    x, k = [sym(s) for s in ode.species], [sym(c) for c in ode.constants]
    scalar = sympy.lambdify([ode.time, x, k], list(ode.rhs), modules="numpy")

    # Jitted: one program each (eagerly, each of their hundreds of operations is
    # compiled on its own).
    @jax.jit
    def both(t, x, k):
        jac = jax.jacfwd(auto.evaluate, argnums=1)(t, x, k)  # JAX's own
        ways = [(rhs(t, x, k), rhs.jacobian(t, x, k)) for rhs in (auto, padded, alone)]
        return ways, jac

    @jax.jit
    def batch(t, x, k, dx, dk):
        return [
            jax.jvp(rhs.batched, (t, x, k), (jnp.zeros_like(t), dx, dk))
            for rhs in (auto, padded, alone)
        ]

    rng = np.random.default_rng(0)
    points, wants, jacs = [], [], []
    for _ in range(3):
        t, xv, kv = 1.5, rng.uniform(0.1, 1e3, len(x)), rng.uniform(0.1, 10, len(k))
        want = np.asarray(scalar(t, xv, kv), np.float64)
        ways, want_j = both(jnp.asarray(t), jnp.asarray(xv), jnp.asarray(kv))
        for got, got_j in ways:
            np.testing.assert_allclose(
                got, want, rtol=1e-12, atol=1e-12 * abs(want).max()
            )
            # The analytic Jacobian against JAX's own derivative.
            np.testing.assert_allclose(
                got_j, want_j, rtol=1e-12, atol=1e-12 * abs(want_j).max()
            )
        points.append((t, xv, kv))
        wants.append(want)
        jacs.append(np.asarray(want_j))

    # The three points as one batch, with a tangent in the states and constants.
    t, xv, kv = (jnp.asarray(np.stack(a)) for a in zip(*points, strict=True))
    dx, dk = rng.normal(size=xv.shape), rng.normal(size=kv.shape)
    want_dk = jax.vmap(
        lambda t, x, k, d: jax.jvp(lambda k: auto.evaluate(t, x, k), (k,), (d,))[1]
    )(t, xv, kv, dk)
    want_t = np.einsum("cij,cj->ci", np.stack(jacs), dx) + want_dk
    want = np.stack(wants)
    for got, got_t in batch(t, xv, kv, jnp.asarray(dx), jnp.asarray(dk)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * abs(want).max())
        np.testing.assert_allclose(
            got_t, want_t, rtol=1e-10, atol=1e-12 * abs(want_t).max()
        )


def test_a_formulas_repeated_subexpressions_are_computed_once():
    # Fiedler et al. 2016's initial states repeat one square root of a polynomial in
    # the parameters within each formula: a symbol (or number) that appears again is
    # the same placeholder of its template, so SymPy's common subexpressions stay
    # common, and the root is traced once (its gradient compiled in 21 s, not 154).
    import sympy

    from sciflat._petab.formulas import Vectorised

    k, a, b, m = sympy.symbols("k a b m", real=True)
    root = sympy.sqrt(k * a**2 + 2.5 * k * b + 2.5)
    exprs = [k * root - (a + root) / (2 * k) + m * root, k * a * b]
    vec = Vectorised(sympy, exprs, [k, a, b, m])
    z = jnp.asarray([1.3, 0.7, 2.1, 0.4])
    jaxpr = jax.make_jaxpr(vec)(z)
    roots = [e for e in jaxpr.eqns if e.primitive.name in ("sqrt", "pow")]
    assert len(roots) == 1
    point = dict(zip((k, a, b, m), np.asarray(z), strict=True))
    want = [float(e.subs(point)) for e in exprs]
    np.testing.assert_allclose(vec(z), want, rtol=1e-14)


def test_initial_states_sharing_a_subexpression_compute_it_once():
    # Fiedler et al. 2016's six initial states each repeat one polynomial of the
    # rates: the formulas together, SymPy's common subexpressions across them, trace
    # it once (one template each traced it six times; its first gradient compiled
    # in 17 s, 6 now), with the same values.
    import sympy

    from sciflat._petab.formulas import Vectorised, initial_states

    k, a, b, m = sympy.symbols("k a b m", real=True)
    root = sympy.sqrt(k * a**2 + 2.5 * k * b + 2.5)
    exprs = [k * root + a, 2 * root - b, root / m, a * b]
    z = jnp.asarray([1.3, 0.7, 2.1, 0.4])
    point = dict(zip((k, a, b, m), np.asarray(z), strict=True))
    want = [float(e.subs(point)) for e in exprs]
    roots = lambda fn: sum(
        e.primitive.name in ("sqrt", "pow") for e in jax.make_jaxpr(fn)(z).eqns
    )
    joint = initial_states(sympy, exprs, [k, a, b, m])
    assert roots(joint) == 1 < roots(Vectorised(sympy, exprs, [k, a, b, m]))
    np.testing.assert_allclose(joint(z), want, rtol=1e-14)
    # Formulas that share nothing keep their templates.
    plain = initial_states(sympy, [k * a, 3 * b], [k, a, b, m])
    assert isinstance(plain, Vectorised)
    np.testing.assert_allclose(plain(z), [1.3 * 0.7, 3 * 2.1], rtol=1e-15)


@pytest.mark.slow  # reads SBML with SymPy: seconds
def test_every_conditions_initial_states_at_once_are_each_conditions(tmp_path):
    # The initial states of all conditions from one trace of their formulas, with
    # the states the condition table sets (B in "low", from a parameter; C in
    # "high", a number), and each condition's own constants.
    table = [
        ("k", "log10", 1e-3, 1e3, K, 1),
        ("scale", "lin", 0.1, 10, SCALE, 1),
        ("sd", "log", 1e-3, 10, SD, 1),
        ("sdB", "lin", 0, 1, SD_B, 0),
        ("b0", "lin", 0, 1, 0.25, 1),
    ]
    conditions = {"low": {"a0": 1.0, "B": "b0"}, "high": {"a0": 2.0, "C": 7.0}}
    path = small_problem(tmp_path, conditions=conditions, parameters_table=table)
    problem = sciflat.petab_problem(path)
    objective = problem._objective
    ext = objective.ext_of(objective.linear(problem.nominal))
    constants, x0 = objective.initial_all(ext)
    low, high = (problem.conditions.index(c) for c in ("low", "high"))
    np.testing.assert_allclose(x0[low], [3.0, 0.25, 5.0], rtol=1e-15)
    np.testing.assert_allclose(x0[high], [6.0, 0.0, 7.0], rtol=1e-15)
    for c in range(len(problem.conditions)):
        index = objective.tables.constant_index[c]
        np.testing.assert_array_equal(constants[c], ext[index])


def test_the_stage_root_finders_linear_solves_are_numpys():
    # StageChord's default linear solver (products with the inverse), forward and
    # transposed, against NumPy's solve of the same system.
    import lineax as lx

    from sciflat._petab.objective import InverseSolver, StageChord

    assert isinstance(StageChord(rtol=1e-8, atol=1e-10).linear_solver, InverseSolver)
    rng = np.random.default_rng(1)
    a = rng.normal(size=(5, 5)) + 3 * np.eye(5)
    b = rng.normal(size=5)
    solver = InverseSolver()
    state = solver.init(lx.MatrixLinearOperator(jnp.asarray(a)), {})
    transposed, _ = solver.transpose(state, {})
    for matrix, st in ((a, state), (a.T, transposed)):
        got, result, _ = solver.compute(st, jnp.asarray(b), {})
        assert result == lx.RESULTS.successful
        np.testing.assert_allclose(got, np.linalg.solve(matrix, b), rtol=1e-12)


@pytest.mark.slow  # the `small` problem (SymPy): seconds
def test_other_tolerances_keep_the_root_finders_options(small):
    # `check_tolerances` solves again at other tolerances: the root finder's own
    # options (here the Lineax LU of before and a looser kappa) stay.
    import diffrax
    import lineax as lx

    from sciflat._petab.objective import Objective, StageChord

    base = small._objective
    finder = StageChord(rtol=1e-8, atol=1e-10, kappa=0.1, linear_solver=lx.LU())
    solver = diffrax.Kvaerno5(root_finder=finder)
    custom = Objective(
        base.tables, base.formulas, diffrax, solver, 1e-8, 1e-10, base._max_steps
    )
    got = custom.with_tolerances(1e-11, 1e-13)._solver.root_finder
    assert (got.rtol, got.atol, got.kappa) == (1e-11, 1e-13, 0.1)
    assert isinstance(got.linear_solver, lx.LU)


@pytest.mark.slow  # SymPy's derivative, and three Jacobians compiled: 2 s of CPU
def test_the_right_hand_sides_jacobian_is_sympys_derivative(tmp_path):
    # The analytic Jacobian (each template's partial derivatives times one-hot
    # columns, an assignment rule on a state chained in, N applied, / compartment
    # sizes) against SymPy's derivative of the substituted right-hand side; the custom
    # JVP against JAX's own derivative, in the state and in the constants. `N`
    # applied both ways: padded rows, and sums over the nonzeros (the rule's chained
    # partials summed by rows).
    import sympy

    from sciflat._petab.formulas import RateLaws
    from sciflat._petab.sbml import read_sbml

    write_sbml(
        tmp_path / "model.xml",
        compartments=(("c1", 2.0), ("c2", 0.5)),
        species=(
            ("A", "c1", 1.0, False, None),
            ("B", "c1", 0.5, False, None),
            ("C", "c2", None, True, 2.0),
        ),
        parameters=(
            ("k1", 1.3, True),
            ("k2", 0.7, True),
            ("h", 2.5, True),
            ("act", 0.0, False),
        ),
        rules=(("act", "B^h / (k2^h + B^h)"),),  # a rule on a state
        reactions=(
            ("R1", {"A": 2}, {"B": 1}, "k1 * A * A * c1"),  # an argument twice
            ("R2", {"B": 1}, {"C": 1}, "k2 * act * B / (1 + A^2.0)"),
            ("R3", {"C": 1}, {"A": 1}, "k1 * C^h"),
            ("R4", {"B": 1}, {}, "k1 * B"),  # the template of R1's, once
            ("R5", {}, {"A": 1}, "k2"),
        ),
    )
    ode = read_sbml(str(tmp_path / "model.xml"))
    ways = [RateLaws(sympy, ode, sparse=sparse) for sparse in (False, True)]
    for rhs, sparse in zip(ways, (False, True), strict=True):
        assert rhs.analytic and len(rhs._on_x) == 1  # `act` depends on B
        assert rhs.sparse_jacobian is sparse and rhs.sparse_rates is sparse
    sym = lambda k: sympy.Symbol(k, real=True)
    x, k = [sym(s) for s in ode.species], [sym(c) for c in ode.constants]
    jac = sympy.Matrix(ode.rhs).jacobian(x)
    want_fn = sympy.lambdify([ode.time, x, k], jac, modules="numpy")
    kv = jnp.asarray([{"c1": 2.0, "c2": 0.5}.get(str(c), 1.1) for c in k])
    t, xs = jnp.asarray(0.5), jnp.asarray([[0.3, 1.7, 2.2], [0.0, 0.4, 1e-3]])

    @jax.jit  # one compilation for all, at both points
    @jax.vmap
    def jacobians(xv):
        def both(f):  # d/dx and d/dk, and d/d(x, k) of J(x, k) v (second order)
            jv = lambda x, k: jax.jvp(lambda y: f(t, y, k), (x,), (xv + 1,))[1]
            return jax.jacfwd(f, argnums=(1, 2))(t, xv, kv), jax.jacfwd(jv, (0, 1))(
                xv, kv
            )

        plain = both(ways[0].evaluate)
        return [(rhs.jacobian(t, xv, kv), both(rhs)) for rhs in ways], plain

    out, plain = jacobians(xs)
    for analytic, custom in out:
        for i, xv in enumerate(np.asarray(xs)):
            want = np.asarray(want_fn(0.5, xv, np.asarray(kv)), np.float64)
            np.testing.assert_allclose(analytic[i], want, rtol=1e-12, atol=1e-14)
        leaves = zip(jax.tree.leaves(custom), jax.tree.leaves(plain), strict=True)
        for got, ref in leaves:
            np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-14)


@pytest.mark.slow  # 34 species, 3 conditions, 600 steps each: tens of seconds
def test_laske_log_likelihood_is_amicis():
    # States of 1e8 and rates of 1e12: Diffrax's own tests of an implicit stage's
    # convergence never passed after t = 2.66 (llh -inf after 100,000 steps).
    problem = sciflat.petab_problem(LASKE)
    np.testing.assert_allclose(
        float(problem.llh(problem.nominal)), LASKE_LLH, rtol=1e-6
    )


@pytest.mark.slow  # compiles two problems' nll and gradient: seconds
def test_check_tolerances_says_when_the_gradient_is_not_converged(
    tmp_path, small, caplog
):
    # Loose tolerances: the check solves again 1e5 times tighter, where nll is the
    # closed form's, and says the gradient moved; at tight ones it says nothing.
    # The loose problem is solved by an explicit method (compiled in a fraction of
    # the default implicit one's time; the check is the same for every solver).
    path = small_problem(tmp_path / "loose")
    loose = sciflat.petab_problem(path, rtol=1e-3, atol=1e-5, solver=diffrax.Tsit5())
    with pytest.warns(UserWarning, match="not converged in the ODE tolerances"):
        out = loose.check_tolerances(loose.nominal, factor=1e5)
    assert out["sensitive"] and out["rtol"] == (1e-3, 1e-3 / 1e5)
    np.testing.assert_allclose(out["nll"][1], small_nll(), rtol=1e-7)
    assert out["grad_error"] > 1e-3 or out["nll_error"] > 1e-6
    # Tight tolerances, the default implicit solver (its Newton tolerance traced
    # too): one program for any factor.
    tight = small  # rtol 1e-11, atol 1e-13
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = tight.check_tolerances(tight.nominal)
    assert not out["sensitive"] and out["grad_error"] < 1e-3
    np.testing.assert_allclose(out["nll"], small_nll(), rtol=1e-8)
    # The tolerances are the program's inputs: another factor compiles nothing.
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        again = tight.check_tolerances(tight.nominal, factor=10.0)
    compiled = [r.getMessage() for r in caplog.records]
    assert not [m for m in compiled if m.startswith("Compiling")], compiled
    assert again["rtol"] == pytest.approx((1e-11, 1e-12))
    assert again["nll"][0] == out["nll"][0]
    with pytest.raises(ValueError, match="`factor` must be > 1"):
        tight.check_tolerances(tight.nominal, factor=0.5)


CRAUSTE = (
    pathlib.Path(__file__).parent
    / "data/petab/Crauste_CellSystems2017/Crauste_CellSystems2017.yaml"
)
# AMICI 1.0.1, rtol 1e-12, atol 1e-14, on this project's machine.
CRAUSTE_LLH = -190.96397757552435


@pytest.mark.slow  # reads and compiles a 5-species model: seconds
def test_crauste_llh_at_the_defaults_is_amicis_converged_one():
    # A knife edge: AMICI at its own defaults is 6e-6 off, BDF choosing its steps as
    # SciPy does (without CVODES's error biases) 1.9e-6; the default is within 1e-6.
    problem = sciflat.petab_problem(CRAUSTE)
    assert isinstance(problem._objective._solver, sciflat.BDF)
    np.testing.assert_allclose(
        float(problem.llh(problem.nominal)), CRAUSTE_LLH, rtol=1e-6
    )


def _objective_again(objective, in_turn):
    """A new `Objective` of the same problem, its `BDF` solves in turn or not."""
    from sciflat._petab.objective import Objective

    again = Objective(
        objective.tables,
        objective.formulas,
        objective._diffrax,
        objective._solver,
        objective.rtol,
        objective.atol,
        objective._max_steps,
    )
    again._bdf_in_turn = in_turn
    return again


@pytest.mark.slow  # compiles the small problem's nll thrice: seconds
def test_bdf_conditions_in_one_batch_or_in_turn_are_the_same_solves(small, monkeypatch):
    # A small model's conditions are one batch (one loop), a large model's solved in
    # turn: each condition takes the same steps either way. And a small model's few
    # simulations go one at a time by default (XLA:CPU runs a loop body kernel after
    # kernel on the calling thread where all its buffers are at most 512 bytes: one
    # simulation of a small model's are, a batch of two's are not): the same solves.
    from sciflat._petab.objective import Objective

    objective = small._objective
    assert isinstance(objective._solver, sciflat.BDF)
    ext = objective.ext(small.nominal)
    linear = objective.linear(small.nominal)
    got = {}
    for in_turn in (False, True):
        again = _objective_again(objective, in_turn)
        # and with their sensitivities (in turn by default, whatever the size)
        jac = jax.jacfwd(lambda v, o=again: o.solve_with_sensitivities(v)[0])
        # (`BDF`'s solves: the default tries this problem's values explicitly first)
        bdf = lambda e, o=again: o.solve_all(e, explicit=False)
        got[in_turn] = (*jax.jit(bdf)(ext), jax.jit(jac)(linear))
    assert bool(got[False][1]) and bool(got[True][1])
    np.testing.assert_allclose(got[False][0], got[True][0], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(got[False][2], got[True][2], rtol=1e-12, atol=1e-15)

    sizes = []
    real = Objective._bdf_solve

    def spy(self, constants, *args, **kwargs):
        sizes.append(constants.shape[0])
        return real(self, constants, *args, **kwargs)

    monkeypatch.setattr(Objective, "_bdf_solve", spy)
    one_at_a_time, ok = jax.jit(lambda e: objective.solve_all(e, explicit=False))(ext)
    assert len(objective._sims.first) == 2 and sizes == [1]
    assert bool(ok)
    np.testing.assert_allclose(one_at_a_time, got[False][0], rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("n_cond", [1, 2, 3, 4, 5, 7, 9, 36])
def test_conditions_solved_in_chunks_come_back_in_their_order(n_cond, whole):
    # `nll`'s solves in turn go a few conditions at a time (`BDF_CHUNK`), the chunks
    # of one size (`whole`: a power of two), the last padded with copies of the last
    # condition: every condition's solution comes back once, in its place, the
    # padding dropped.
    from sciflat._petab.objective import BDF_CHUNK, _Chunks, _in_chunks

    rng = np.random.default_rng(n_cond)
    # (small integers: the fake solve's products are exact in any program)
    constants = jnp.asarray(rng.integers(-5, 5, (n_cond, 3)), jnp.float64)
    x0 = jnp.asarray(rng.integers(-5, 5, (n_cond, 2)), jnp.float64)
    sizes = []

    def solve(k, x):  # a batch's "solutions": (C, T, n), and whether each is fine
        sizes.append(k.shape[0])
        ys = x[:, None, :] * jnp.arange(1.0, 5.0)[None, :, None] + k[:, :1, None]
        return ys, jnp.all(jnp.isfinite(ys), axis=(1, 2)) & (k[:, 1] > -9)

    chunked = lambda k, x: _in_chunks(solve, (k, x), BDF_CHUNK, whole)
    ys, ok = jax.jit(chunked)(constants, x0)
    want, want_ok = solve(constants, x0)
    np.testing.assert_array_equal(ys, want)
    np.testing.assert_array_equal(ok, want_ok)
    chunk = sizes[0]
    assert chunk <= BDF_CHUNK and -(-n_cond // chunk) == -(-n_cond // BDF_CHUNK)
    if whole:
        assert chunk in (1, 2, 4) and chunk >= n_cond / -(-n_cond // BDF_CHUNK)
    else:
        assert chunk == -(-n_cond // -(-n_cond // BDF_CHUNK))
    # (The adjoint's cotangents are padded with zeros.)
    chunks = _Chunks.of(n_cond, BDF_CHUNK, whole)
    split = chunks.split(x0, pad=0.0)
    assert split.shape == (chunks.number, chunk, 2)
    np.testing.assert_array_equal(chunks.joined(split), x0)
    assert not np.any(split.reshape(-1, 2)[n_cond:])


@pytest.mark.slow  # reads the small problem thrice and compiles its gradients
def test_bdf_gradients_converge_with_the_tolerances_as_the_values(tmp_path):
    # BDF's `control_sensitivities` (the default, up to 100 directions): the solves
    # that give a gradient choose their steps by the sensitivities' errors too, as
    # AMICI's do. At rtol 1e-6 the gradient is 1.2e-7 off its converged value with
    # them, 1.2e-6 along the state's steps alone, and 4e-8 by the adjoint of a
    # solve at 1e-8. (`nll`'s values by BDF too: `explicit_first=False`.)
    path = small_problem(tmp_path / "small")
    problems = {
        control: sciflat.petab_problem(
            path,
            rtol=1e-6,
            atol=1e-8,
            solver=sciflat.BDF(
                control_sensitivities=control is not False,
                adjoint=control == "adjoint",
                explicit_first=False,
            ),
        )
        for control in (True, False, "adjoint")
    }
    # The converged gradient: the closed form's (log10 k, scale, log sd).
    assert problems[True].parameter_ids == ("k", "scale", "sd")
    p, re = sciflat.destructure(problems[True].nominal, dtype=jnp.float64)
    closed = small_nll_of_p
    ref = jax.grad(closed)(p)
    errors = {}
    for control, problem in problems.items():
        f = lambda x, problem=problem: problem.nll(re(x))
        value, grad = jax.jit(jax.value_and_grad(f))(p)
        errors[control] = float(jnp.linalg.norm(grad - ref) / jnp.linalg.norm(ref))
        if not control:  # the derivative of `nll`'s own solves: its value, the bits
            np.testing.assert_allclose(value, jax.jit(f)(p), rtol=1e-15)
        else:  # other steps: within the tolerances of the closed form
            np.testing.assert_allclose(value, closed(p), rtol=1e-5)
    assert errors[True] < 4e-7 < 6e-7 < errors[False]
    # The adjoint of a solve 100 times tighter (the default from 20 species) in
    # place of the control: the state's steps alone, and closer still.
    assert errors["adjoint"] < errors[True] / 2


@pytest.mark.slow  # compiles the small problem's sensitivities 5 times: seconds
def test_sensitivities_are_computed_for_the_parameters_the_solves_read(
    small, monkeypatch
):
    # `scale` and `sd` are in the noise model only: their columns are zeros, not
    # directions carried through the solves; the others are the full Jacobian's.
    from sciflat._petab import bdf as bdf_module
    from sciflat._petab.objective import Objective, dynamic_parameters

    objective = small._objective
    ids = objective.tables.parameters.ids
    dynamic = dynamic_parameters(objective.tables)
    assert [ids[i] for i in dynamic] == ["k"]
    linear = objective.linear(small.nominal)
    # (BDF's solve: the derivatives are BDF's whatever solves the values)
    bdf = lambda v: objective.solve_all(objective.ext_of(v), explicit=False)[0]
    full = jax.jit(jax.jacfwd(bdf))(linear)

    def sensitivities(bdf):
        again = Objective(
            objective.tables,
            objective.formulas,
            objective._diffrax,
            bdf,
            objective.rtol,
            objective.atol,
            objective._max_steps,
        )
        f = lambda v: again.solve_with_sensitivities(v)[0]
        return np.asarray(jax.jit(jax.jacfwd(f))(linear))

    jacs = {}
    for control in (True, False):
        jac = jacs[control] = sensitivities(sciflat.BDF(control_sensitivities=control))
        others = [i for i in range(len(ids)) if i not in dynamic]
        assert others and not np.any(jac[..., others])
        # along the state's steps: the full Jacobian's columns; controlled: within
        # the tolerances (1e-11) of them
        rtol = 1e-6 if control else 1e-12
        np.testing.assert_allclose(jac, full, rtol=rtol, atol=1e-12)
    # The default: controlled up to `CONTROL_UP_TO` directions, along the state's
    # steps beyond (here 1 direction, so the limit is lowered to 0 to see it).
    np.testing.assert_array_equal(sensitivities(sciflat.BDF()), jacs[True])
    monkeypatch.setattr(bdf_module, "CONTROL_UP_TO", 0)
    np.testing.assert_array_equal(sensitivities(sciflat.BDF()), jacs[False])


RAIA = (
    pathlib.Path(__file__).parent
    / "data/petab/Raia_CancerResearch2011/Raia_CancerResearch2011.yaml"
)
# AMICI 1.0.1, rtol 1e-12, atol 1e-14, on this project's machine (the issue that asked
# for Raia quotes -346.08978136).
RAIA_LLH = -346.0897813604339


@pytest.mark.slow  # 4 conditions, 14 species: compiles Diffrax solves, seconds
def test_raia_noise_formulas_with_observable_parameters_give_amicis_llh():
    problem = sciflat.petab_problem(RAIA)
    np.testing.assert_allclose(float(problem.llh(problem.nominal)), RAIA_LLH, rtol=1e-6)
