"""Rodas5P, a Rosenbrock method for stiff ODEs, as a Diffrax solver.

A Rosenbrock method is linearly implicit: each step factorises one matrix,
`W = I / (h γ) - J` with `J` the Jacobian of the vector field at the step's start, and
its eight stages are solves with that one factorisation (here, products with its
inverse). An implicit Runge–Kutta method (Diffrax's `Kvaerno5`) instead runs Newton's
method in each of its stages, a Jacobian and a factorisation per iteration. For the
small, stiff reaction networks of systems biology that is most of the cost of a step
(PEtab.jl's default for such models is this method, Rodas5P).

The coefficients are those of Steinebach (2023), "Construction of Rosenbrock–Wanner
method Rodas5P and numerical benchmarks within the Julia Differential Equations
package", BIT Numerical Mathematics 63:27; the stages are written in the transformed
variables of Hairer & Wanner, *Solving ODEs II*, §IV.7 (the form of their RODAS code):

    (I / (h γ) - J) u_i = f(t0 + c_i h, y0 + Σ_j a_ij u_j) + Σ_j (C_ij / h) u_j
                          + h d_i ∂f/∂t(t0, y0),

stages 7 and 8 start from the previous stage's value plus its increment (the method is
stiffly accurate), `y1 = Y_8 + u_8`, and the error estimate is `u_8` (order 4).
"""

from collections.abc import Callable
from typing import ClassVar

import diffrax
import jax
import jax.numpy as jnp


_GAMMA = 0.21193756319429014
# a_ij of stages 2 to 6, row by row (stage i uses i - 1 of them).
_A = (
    (3.0,),
    (2.849394379747939, 0.45842242204463923),
    (-6.954028509809101, 2.489845061869568, -10.358996098473584),
    (2.8029986275628964, 0.5072464736228206, -0.3988312541770524, -0.04721187230404641),
    (
        -7.502846399306121,
        2.561846144803919,
        -11.627539656261098,
        -0.18268767659942256,
        0.030198172008377946,
    ),
)
# C_ij of stages 2 to 8.
_C = (
    (-14.155112264123755,),
    (-17.97296035885952, -2.859693295451294),
    (147.12150275711716, -1.41221402718213, 71.68940251302358),
    (165.43517024871676, -0.4592823456491126, 42.90938336958603, -5.961986721573306),
    (
        24.854864614690072,
        -3.0009227002832186,
        47.4931110020768,
        5.5814197821558125,
        -0.6610691825249471,
    ),
    (
        30.91273214028599,
        -3.1208243349937974,
        77.79954646070892,
        34.28646028294783,
        -19.097331116725623,
        -28.087943162872662,
    ),
    (
        37.80277123390563,
        -3.2571969029072276,
        112.26918849496327,
        66.9347231244047,
        -40.06618937091002,
        -54.66780262877968,
        -9.48861652309627,
    ),
)
_STAGE_C = (
    0.0,
    0.6358126895828704,
    0.4095798393397535,
    0.9769306725060716,
    0.4288403609558664,
    1.0,
    1.0,
    1.0,
)
_D = (
    0.21193756319429014,
    -0.42387512638858027,
    -0.3384627126235924,
    1.8046452872882734,
    2.325825639765069,
    0.0,
    0.0,
    0.0,
)


@jax.custom_jvp
def _solve(inverse: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """`W⁻¹ b`, with `inverse` the inverse of `W` (taken without derivative).

    Its derivative is `W⁻¹ (db − dW x)`, `x = W⁻¹ b`, applied with the inverse
    already there. `dW` is the tangent of `W = I / (h γ) − J`, that is of the
    Jacobian `J`: JAX computes it once per step (the forward derivative of `J` in
    the state and the parameters), and each of the eight stages applies it as one
    product. JAX's own rules would differentiate the inversion too (triangular
    solves of whole matrices, per tangent, in every step)."""
    return inverse @ b


@_solve.defjvp
def _solve_jvp(primals, tangents):
    # Both products by `_solve` itself: differentiated again (a Hessian), each
    # is this rule once more, with `W`'s tangent in the second derivative
    # (`inverse` has none).
    inverse, w, b = primals
    _, dw, db = tangents
    x = _solve(inverse, w, b)
    return x, _solve(inverse, w, db - dw @ x)


class Rodas5P(diffrax.AbstractAdaptiveSolver):
    """Rodas5P (Steinebach 2023): a 5th-order, stiffly accurate Rosenbrock method
    with a 4th-order error estimate, as a Diffrax solver for stiff ODEs whose state is
    one 1-d array. Each step costs one Jacobian of the vector field (forward mode),
    one inversion (LU) and eight evaluations of the vector field; an implicit
    Runge–Kutta method such as `diffrax.Kvaerno5` costs a Jacobian and a factorisation
    per Newton iteration of each of its stages.

    Its dense output is linear between the ends of a step: save at times the steps
    end on (`diffrax.ClipStepSizeController(..., step_ts=ts)`), as
    [`sciflat.petab_problem`][] does.

    !!! Example

        ```python
        import diffrax, jax.numpy as jnp, sciflat

        def robertson(t, y, args):  # a classic stiff test problem
            a, b, c = y
            return jnp.stack([-0.04 * a + 1e4 * b * c,
                              0.04 * a - 1e4 * b * c - 3e7 * b**2,
                              3e7 * b**2])

        ts = jnp.array([1.0, 10.0, 100.0])
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(robertson), sciflat.Rodas5P(), t0=0.0, t1=100.0,
            dt0=None, y0=jnp.array([1.0, 0.0, 0.0]), saveat=diffrax.SaveAt(ts=ts),
            stepsize_controller=diffrax.ClipStepSizeController(
                diffrax.PIDController(rtol=1e-8, atol=1e-10), step_ts=ts))
        ```
    """

    term_structure: ClassVar = diffrax.AbstractTerm
    interpolation_cls: ClassVar[Callable[..., diffrax.LocalLinearInterpolation]] = (
        diffrax.LocalLinearInterpolation
    )

    def order(self, terms):
        del terms
        return 5

    def error_order(self, terms):
        del terms
        return 4

    def init(self, terms, t0, t1, y0, args):
        del terms, t0, t1, y0, args
        return None

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        if not isinstance(y0, jax.Array) or y0.ndim != 1:
            raise ValueError(
                "`Rodas5P` solves ODEs whose state is one 1-d array; got "
                f"{type(y0).__name__} of shape {getattr(y0, 'shape', None)}."
            )
        h = t1 - t0

        def f(t, y):
            return terms.vf(t, y, args)

        dt_f = jax.jvp(lambda t: f(t, y0), (t0,), (jnp.ones_like(t0),))[1]
        jac = jax.jacfwd(lambda y: f(t0, y))(y0)
        n = y0.shape[0]
        w = jnp.eye(n, dtype=y0.dtype) / (h * _GAMMA) - jac
        # W inverted once (LU, its triangular solves on the identity together):
        # each stage's solve is then a product, which fuses with the stage; on the
        # host a triangular solve of one vector is a call of microseconds, more than
        # a small model's vector field. Its rounding is the LU solve's, cond(W) eps.
        # `_solve` differentiates the solves with `W`'s own tangent.
        inverse = jnp.linalg.inv(jax.lax.stop_gradient(w))
        us: list[jax.Array] = []
        y_stage = y0
        for i in range(8):
            if 1 <= i <= 5:
                y_stage = y0 + sum(a * u for a, u in zip(_A[i - 1], us, strict=True))
            elif i >= 6:
                y_stage = y_stage + us[-1]
            rhs = f(t0 + _STAGE_C[i] * h, y_stage)
            if i:
                rhs = rhs + sum(c * u for c, u in zip(_C[i - 1], us, strict=True)) / h
            if _D[i]:
                rhs = rhs + (h * _D[i]) * dt_f
            us.append(_solve(inverse, w, rhs))
        y1 = y_stage + us[-1]
        dense_info = dict(y0=y0, y1=y1)
        return y1, us[-1], dense_info, None, diffrax.RESULTS.successful

    def func(self, terms, t0, y0, args):
        return terms.vf(t0, y0, args)
