"""The user-facing autodiff API: grad, value_and_grad, autodiff, custom_vjp/jvp, jit.

Everything here is a thin layer over ``jax.grad`` / ``jax.vjp`` / ``jax.custom_vjp`` /
``jax.jit``; Tessera operators carry their own adjoints (JVP and transpose rules
next to each primitive), so a ``ts.grad`` backward pass is a graph of ts operators.

What the layer adds:

* ``wrt=("W", "b")``: select differentiated arguments by parameter name;
* loss scaling for mixed-precision training (``loss_scale=`` or a
  ``ts.loss_scale(s)`` in the argument annotations), with a finiteness flag;
* ``@ts.autodiff``'s ``f.adjoint_graph(*args)``: the backward pass as a jaxpr;
* ``ts.jit``: ``jax.jit`` plus the ``ts.Tensor[...]`` annotation checks
  (tessera_jax/numerics/annotations.py) and the accumulation policies.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tessera_jax._config import command_buffer_options, deterministic_compile_options
from tessera_jax.numerics import annotations as _ann
from tessera_jax.numerics.context import accumulation
from tessera_jax.numerics.dtypes import LossScale
from tessera_jax.primitives._core import is_float
from tessera_jax.sharding import regions

__all__ = ["autodiff", "custom_jvp", "custom_vjp", "grad", "jit", "value_and_grad"]


# --- argument selection -----------------------------------------------------------------


def _check_callable(api: str, f: Any) -> None:
    if not callable(f):
        raise TypeError(f"{api}: expected a function, got a {type(f).__name__}")


def _fname(f: Callable) -> str:
    return getattr(inspect.unwrap(f), "__name__", None) or type(f).__name__


def _signature(api: str, f: Callable) -> inspect.Signature:
    try:
        return inspect.signature(f)  # follows __wrapped__: ts.jit, @ts.autodiff, jax.jit
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{api}: wrt= needs the parameter names of {_fname(f)}, but its signature cannot "
            f"be read ({e}); use argnums="
        ) from None


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _check_argnums(api: str, argnums: Any) -> int | tuple[int, ...]:
    """``argnums`` as an int or a non-empty tuple of distinct ints (negative: from the end)."""
    if _is_int(argnums):
        return int(argnums)
    if isinstance(argnums, (tuple, list)) and argnums and all(_is_int(a) for a in argnums):
        nums = tuple(int(a) for a in argnums)
        if len(set(nums)) != len(nums):
            raise ValueError(f"{api}: {argnums=} repeats a position")
        return nums
    raise TypeError(
        f"{api}: argnums={argnums!r} must be an int or a non-empty tuple of ints "
        "(positions of the differentiated arguments)"
    )


def _resolve_argnums(api: str, f: Callable, argnums, n_args: int):
    """``argnums`` made non-negative for a call with ``n_args`` positional arguments."""
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    for a in nums:
        if not -n_args <= a < n_args:
            raise ValueError(
                f"{api}: argnums={argnums} is out of range: {_fname(f)} was called with "
                f"{n_args} positional argument(s), so a position must be in [{-n_args}, {n_args})"
            )
    out = tuple(a % n_args for a in nums)
    if len(set(out)) != len(out):
        raise ValueError(f"{api}: argnums={argnums} names one of the {n_args} arguments twice")
    return out if isinstance(argnums, tuple) else out[0]


def _check_differentiable(api: str, f: Callable, argnums, args: tuple) -> None:
    """TypeError unless every leaf of the differentiated arguments is a float/complex array."""
    for i in argnums if isinstance(argnums, tuple) else (argnums,):
        for leaf in jax.tree.leaves(args[i]):
            dt = np.dtype(jnp.result_type(leaf))
            if not jnp.issubdtype(dt, jnp.inexact):
                raise TypeError(
                    f"{api}: argument {i} of {_fname(f)} has dtype {dt}; differentiated "
                    "arguments must be float or complex (pass integer inputs at other positions)"
                )


def _checked_loss(api: str, f: Callable, has_aux: bool) -> Callable:
    """``f`` with its output checked: a scalar float loss, or ``(loss, aux)`` with has_aux."""

    @functools.wraps(f)
    def checked(*args, **kwargs):
        out = f(*args, **kwargs)
        if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
            what = (
                f"an array of shape {jnp.shape(out)}"
                if hasattr(out, "shape")
                else f"a {type(out).__name__}"
            )
            raise TypeError(
                f"{api}: has_aux=True but {_fname(f)} returned {what}, not a (loss, aux) pair"
            )
        loss = out[0] if has_aux else out
        shape, dt = jnp.shape(loss), np.dtype(jnp.result_type(loss))
        if shape != () or not jnp.issubdtype(dt, jnp.inexact):
            raise TypeError(
                f"{api}: {_fname(f)} must return a scalar float loss"
                f"{' (first of the (loss, aux) pair)' if has_aux else ''}, got shape {shape} "
                f"dtype {dt}"
            )
        return out

    return checked


def _wrt_argnums(
    api: str, f: Callable, wrt: Any, argnums: Any
) -> tuple[int | tuple[int, ...], inspect.Signature]:
    """``wrt`` (a name or a tuple of names) as jax ``argnums`` (an int or a tuple)."""
    if argnums != 0:
        raise ValueError(
            f"{api}: pass either wrt= or argnums=, not both (got wrt={wrt!r}, argnums={argnums!r})"
        )
    single = isinstance(wrt, str)
    if not single and not isinstance(wrt, (tuple, list)):
        raise TypeError(f"{api}: wrt={wrt!r} must be a parameter name or a tuple of names")
    names = (wrt,) if single else tuple(wrt)
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{api}: wrt={wrt!r} must be a parameter name or a tuple of names")
    if len(set(names)) != len(names):
        raise ValueError(f"{api}: wrt={wrt!r} names a parameter twice")
    sig = _signature(api, f)
    params = list(sig.parameters.values())
    listing = ", ".join(p.name for p in params)
    idx = []
    for n in names:
        p = sig.parameters.get(n)
        if p is None:
            raise ValueError(
                f"{api}: wrt={n!r} is not a parameter of {_fname(f)}; "
                f"its parameters are ({listing})"
            )
        if p.kind not in _POSITIONAL:
            raise ValueError(
                f"{api}: wrt={n!r} is a keyword-only or variadic parameter of {_fname(f)}; "
                "only positional parameters can be differentiated"
            )
        idx.append(params.index(p))
    return (idx[0] if single else tuple(idx)), sig


def _as_positional(sig: inspect.Signature, argnums, args: tuple, kwargs: dict):
    """Moves differentiated arguments passed by keyword (or left at their default) into args."""
    top = max(argnums) if isinstance(argnums, tuple) else argnums
    if top < len(args):
        return args, kwargs
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"the arguments do not match the signature {sig}: {e}") from None
    bound.apply_defaults()
    return bound.args, bound.kwargs


def _argnum_names(f: Callable, argnums) -> list[str]:
    """Parameter names of the differentiated positions (positions past the named ones dropped)."""
    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError):
        return []
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    return [params[i].name for i in nums if i < len(params) and params[i].kind in _POSITIONAL]


# --- loss scaling -----------------------------------------------------------------------


def _as_scale(api: str, loss_scale: Any) -> Any:
    """``loss_scale=`` as a Python float or a scalar float array (dynamic loss scaling)."""
    if isinstance(loss_scale, LossScale):
        return loss_scale.scale
    if isinstance(loss_scale, (jax.Array, np.ndarray)):
        if loss_scale.ndim != 0 or not is_float(loss_scale.dtype):
            raise TypeError(
                f"{api}: loss_scale must be a scalar float array, got shape "
                f"{loss_scale.shape} dtype {loss_scale.dtype}"
            )
        return loss_scale
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        return LossScale(float(loss_scale)).scale  # validates: positive and finite
    if hasattr(loss_scale, "storage"):  # a Policy or a precision policy
        s = _ann.policy_loss_scale(loss_scale)
        if s is None:
            raise ValueError(f"{api}: the policy {loss_scale!r} carries no ts.loss_scale(...)")
        return s
    raise TypeError(
        f"{api}: loss_scale={loss_scale!r} must be a number, ts.loss_scale(s), a policy with "
        "ts.loss_scale, or a scalar float array"
    )


def _annotated_scale(api: str, f: Callable, argnums) -> float | None:
    """The ``ts.loss_scale`` in the annotations of the differentiated parameters."""
    s = _ann.signature_of(f)
    if s is None:
        return None
    found = {}
    for name in _argnum_names(f, argnums):
        spec = s.params.get(name)
        if spec is not None and spec.loss_scale is not None:
            found[name] = spec.loss_scale
    if len(set(found.values())) > 1:
        raise ValueError(
            f"{api}: the differentiated arguments of {s.name} carry different loss scales "
            f"{found}; pass loss_scale= explicitly"
        )
    return next(iter(found.values()), None)


def _at_least_f32(dtype: Any) -> np.dtype:
    """f32 for 8/16-bit floats, else ``dtype`` (the precision loss scaling works in)."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def _unscale(grads: Any, scale: Any) -> tuple[Any, jax.Array]:
    """Gradients divided by ``scale`` in (at least) f32, and whether all are finite."""

    def one(g):
        if not jnp.issubdtype(g.dtype, jnp.inexact):
            return g  # float0 cotangents of integer arguments
        dt = _at_least_f32(g.dtype)
        return g.astype(dt) / jnp.asarray(scale, dt)

    grads = jax.tree.map(one, grads)
    flags = [
        jnp.all(jnp.isfinite(g))
        for g in jax.tree.leaves(grads)
        if jnp.issubdtype(g.dtype, jnp.inexact)
    ]
    finite = functools.reduce(jnp.logical_and, flags, jnp.asarray(True))
    return grads, finite


# --- grad / value_and_grad --------------------------------------------------------------


def _transform(f, argnums, wrt, has_aux, loss_scale, with_value: bool):
    api = "ts.value_and_grad" if with_value else "ts.grad"
    _check_callable(api, f)
    if not isinstance(has_aux, (bool, np.bool_)):
        raise TypeError(f"{api}: has_aux={has_aux!r} must be a bool")
    has_aux = bool(has_aux)
    sig = None
    if wrt is not None:
        argnums, sig = _wrt_argnums(api, f, wrt, argnums)
    argnums = _check_argnums(api, argnums)
    static_scale = None if loss_scale is None else _as_scale(api, loss_scale)
    annotated: dict[Any, Any] = {}  # the annotation's scale, by resolved argnums
    checked_f = _checked_loss(api, f, has_aux)

    def scale_for_call(nums):
        if loss_scale is not None:
            return static_scale
        if nums not in annotated:
            annotated[nums] = _annotated_scale(api, f, nums)
        return annotated[nums]

    @functools.wraps(f, updated=())
    def transformed(*args, **kwargs):
        if sig is not None:
            try:
                args, kwargs = _as_positional(sig, argnums, args, kwargs)
            except TypeError as e:
                raise TypeError(f"{api}: {_fname(f)}: {e}") from None
        nums = _resolve_argnums(api, f, argnums, len(args))
        _check_differentiable(api, f, nums, args)
        scale = scale_for_call(nums)
        if scale is None:
            fn = jax.value_and_grad if with_value else jax.grad
            return fn(checked_f, nums, has_aux=has_aux)(*args, **kwargs)

        def scaled(*a, **k):
            out = checked_f(*a, **k)
            loss, aux = out if has_aux else (out, None)
            loss_arr = jnp.asarray(loss)
            dt = _at_least_f32(loss_arr.dtype)
            return loss_arr.astype(dt) * jnp.asarray(scale, dt), (loss, aux)

        (_, (value, aux)), grads = jax.value_and_grad(scaled, nums, has_aux=True)(*args, **kwargs)
        grads, finite = _unscale(grads, scale)
        if with_value:
            return ((value, aux) if has_aux else value), grads, finite
        return (grads, aux, finite) if has_aux else (grads, finite)

    return transformed


def grad(
    f: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    wrt: str | Sequence[str] | None = None,
    has_aux: bool = False,
    loss_scale: Any = None,
) -> Callable:
    """The gradient of a scalar function, as ``jax.grad``, with names and loss scaling.

    **Arguments:**

    - ``f``: returns a scalar loss (or ``(loss, aux)`` with ``has_aux``). A ``ts.jit``,
      ``@ts.autodiff`` or ``jax.jit`` function works: names are read through ``__wrapped__``.
    - ``argnums``: positions differentiated, an int (a bare gradient) or a tuple (a tuple).
    - ``wrt``: instead of ``argnums``, parameter names: ``wrt="W"`` gives a bare gradient,
      ``wrt=("W", "b")`` a tuple. The two are exclusive (leave ``argnums`` at its default).
      The named arguments may be passed positionally, by keyword or left at their default.
    - ``loss_scale``: a positive number, ``ts.loss_scale(s)``, a policy carrying
      ``ts.loss_scale(s)`` or a scalar float array (dynamic loss scaling). When None, a
      ``ts.loss_scale(s)`` in the ``ts.Tensor`` annotation of a differentiated parameter
      is used. The loss is multiplied by ``s`` (in at least f32) before differentiating and
      the gradients divided by ``s`` afterwards, in f32 (f64 for f64 arguments): the
      gradients of 8/16-bit arguments come back in f32, as the master gradients of
      mixed-precision training.

    **Returns:** a function of ``f``'s arguments returning

    ============================  ========================  ============================
    loss scaling                  ``has_aux=False``         ``has_aux=True``
    ============================  ========================  ============================
    off                           ``grads``                 ``(grads, aux)``
    on                            ``(grads, finite)``       ``(grads, aux, finite)``
    ============================  ========================  ============================

    ``finite`` is a bool scalar array: every gradient is finite (no overflow at this
    scale). A training step skips the update and lowers the scale when it is False.
    """
    return _transform(f, argnums, wrt, has_aux, loss_scale, with_value=False)


def value_and_grad(
    f: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    wrt: str | Sequence[str] | None = None,
    has_aux: bool = False,
    loss_scale: Any = None,
) -> Callable:
    """The value and gradient of a scalar function; arguments as :func:`grad`.

    **Returns:** a function of ``f``'s arguments returning

    ============================  ============================  ===================================
    loss scaling                  ``has_aux=False``             ``has_aux=True``
    ============================  ============================  ===================================
    off                           ``(value, grads)``            ``((value, aux), grads)``
    on                            ``(value, grads, finite)``    ``((value, aux), grads, finite)``
    ============================  ============================  ===================================

    With loss scaling, ``value`` is the unscaled loss as ``f`` returned it.
    """
    return _transform(f, argnums, wrt, has_aux, loss_scale, with_value=True)


# --- operator graphs --------------------------------------------------------------------


def autodiff(f: Callable) -> Callable:
    """Marks ``f`` as a differentiable operator graph; calling it is unchanged.

    ``f.adjoint_graph(*args, **kwargs)`` returns the backward pass as a
    ``jax.core.ClosedJaxpr``: the VJP of ``f`` with respect to every positional
    argument (keyword arguments held fixed), applied to a cotangent of ones. Its
    equations are the adjoints of the ts operators in ``f`` (``ts_matmul``, …),
    with the forward residuals as constants.
    """
    _check_callable("ts.autodiff", f)

    @functools.wraps(f)
    def graph(*args, **kwargs):
        return f(*args, **kwargs)

    def adjoint_graph(*args, **kwargs):
        out, vjp_fn = jax.vjp(functools.partial(f, **kwargs), *args)
        return jax.make_jaxpr(vjp_fn)(jax.tree.map(jnp.ones_like, out))

    graph.adjoint_graph = adjoint_graph
    graph.__tessera_autodiff__ = True
    return graph


def _n_positional(api: str, fun: Callable, nondiff_argnums, nondiff_argnames) -> int | None:
    """How many differentiated positional parameters ``fun`` has (None: variadic/unknown)."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    pos = [p for i, p in enumerate(params) if p.kind in _POSITIONAL and i not in nondiff_argnums]
    return len([p for p in pos if p.name not in nondiff_argnames])


def _check_nondiff_argnums(api: str, fun: Callable, nums: Any) -> tuple[int, ...]:
    """``nondiff_argnums`` (an int or a tuple of them) as a tuple of valid positions."""
    nums = (nums,) if _is_int(nums) else nums
    if not isinstance(nums, (tuple, list)) or not all(_is_int(n) for n in nums):
        raise TypeError(f"{api}: nondiff_argnums={nums!r} must be an int or a tuple of ints")
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return tuple(int(n) for n in nums)
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return tuple(int(n) for n in nums)
    n_pos = sum(p.kind in _POSITIONAL for p in params)
    for n in nums:
        if not 0 <= n < n_pos:
            raise ValueError(
                f"{api}: nondiff_argnums={tuple(nums)} names position {n}, but {_fname(fun)} "
                f"has {n_pos} positional parameter(s) (positions 0..{n_pos - 1})"
            )
    return tuple(int(n) for n in nums)


def _check_nondiff_argnames(api: str, names: Any) -> tuple[str, ...]:
    """``nondiff_argnames`` (a name or a tuple of names) as a tuple."""
    names = (names,) if isinstance(names, str) else names
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{api}: nondiff_argnames={names!r} must be a name or a tuple of names")
    return tuple(names)


class _CustomRule:
    """Shared by custom_vjp / custom_jvp: a callable wrapping the jax object (``_jax_cls``),
    usable as ``@rule`` or ``@rule(nondiff_argnums=...)``; ``_api`` names it in errors."""

    _jax_cls: Any = None
    _api: str = ""

    def __new__(cls, fun=None, nondiff_argnums=(), nondiff_argnames=()):
        if fun is None:
            return lambda g: cls(g, nondiff_argnums, nondiff_argnames)
        return super().__new__(cls)

    def __init__(self, fun: Callable, nondiff_argnums=(), nondiff_argnames=()):
        _check_callable(self._api, fun)
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.nondiff_argnums = _check_nondiff_argnums(self._api, fun, nondiff_argnums)
        self.nondiff_argnames = _check_nondiff_argnames(self._api, nondiff_argnames)
        extra = {"nondiff_argnames": self.nondiff_argnames} if self.nondiff_argnames else {}
        self._rule = self._jax_cls(fun, nondiff_argnums=self.nondiff_argnums, **extra)

    _rule_attr: str = ""  # the jax object's attribute set by the def* method
    _define: str = ""  # how the rule is defined, for the error message

    def __call__(self, *args, **kwargs):
        if getattr(self._rule, self._rule_attr, "") is None:
            name = _fname(self.fun)
            raise TypeError(
                f"{self._api}: {name} has no derivative rule yet; define it with "
                f"{name}.{self._define} before calling {name}"
            )
        return self._rule(*args, **kwargs)

    def __get__(self, obj, objtype=None):
        return self if obj is None else functools.partial(self, obj)

    def __repr__(self) -> str:
        return f"ts.{type(self).__name__}({_fname(self.fun)})"


class custom_vjp(_CustomRule):
    """``jax.custom_vjp`` for ts code: ``@ts.custom_vjp`` then ``f.defvjp(fwd, bwd)``.

    ``fwd(*args) -> (out, residuals)``; ``bwd(residuals, ct_out)`` returns one
    cotangent per differentiated argument, as a tuple; a function of one
    argument may return it bare (``return grad_input``; if that argument is
    itself a tuple, return ``(ct,)``). Also usable as
    ``@ts.custom_vjp(nondiff_argnums=(1,))``.
    """

    _jax_cls = jax.custom_vjp
    _api = "ts.custom_vjp"
    _rule_attr = "fwd"
    _define = "defvjp(fwd, bwd)"

    def defvjp(self, fwd: Callable, bwd: Callable, **kwargs) -> None:
        """Sets the forward (``fwd``) and backward (``bwd``) rules; as ``jax.custom_vjp.defvjp``."""
        _check_callable("ts.custom_vjp.defvjp", fwd)
        _check_callable("ts.custom_vjp.defvjp", bwd)
        one_arg = (
            _n_positional(self._api, self.fun, self.nondiff_argnums, self.nondiff_argnames) == 1
        )

        @functools.wraps(bwd)
        def bwd_tuple(*a):
            ct = bwd(*a)
            return (ct,) if one_arg and not isinstance(ct, tuple) else ct

        self._rule.defvjp(fwd, bwd_tuple, **kwargs)


class custom_jvp(_CustomRule):
    """``jax.custom_jvp`` for ts code: ``@ts.custom_jvp`` then ``@f.defjvp``.

    ``jvp(primals, tangents) -> (primal_out, tangent_out)``. Also usable as
    ``@ts.custom_jvp(nondiff_argnums=(1,))``.
    """

    _jax_cls = jax.custom_jvp
    _api = "ts.custom_jvp"
    _rule_attr = "jvp"
    _define = "defjvp(jvp)"

    def defjvp(self, jvp: Callable, **kwargs) -> Callable:
        """Sets the JVP rule; returns it, so ``@f.defjvp`` works as a decorator."""
        _check_callable("ts.custom_jvp.defjvp", jvp)
        self._rule.defjvp(jvp, **kwargs)
        return jvp

    def defjvps(self, *tangent_fns: Callable | None) -> None:
        """One ``tangent_fn(t, primal_out, *primals)`` per argument, as in jax."""
        for i, fn in enumerate(tangent_fns):
            if fn is not None and not callable(fn):
                raise TypeError(
                    f"ts.custom_jvp.defjvps: tangent_fns[{i}]={fn!r} must be a function or None"
                )
        self._rule.defjvps(*tangent_fns)


# --- jit --------------------------------------------------------------------------------


def _checked(f: Callable) -> Callable:
    """``f`` with its ``ts.Tensor`` annotations checked and applied at trace time."""
    resolved: list[_ann.Signature | None] = []  # resolved at the first trace (forward refs)

    @functools.wraps(f)
    def body(*args, **kwargs):
        if not resolved:
            resolved.append(_ann.signature_of(f))
        s = resolved[0]
        if s is None or s.empty:
            return f(*args, **kwargs)
        dims = _ann.check_arguments(s, args, kwargs)
        acc = s.accumulate()
        with accumulation(acc) if acc is not None else contextlib.nullcontext():
            out = f(*args, **kwargs)
        return _ann.finish_output(s, dims, out)

    return body


def _with_option(jit_kwargs: dict[str, Any], arg: str, value: Any, wanted: dict[str, Any]):
    """``jit_kwargs`` with ``wanted`` merged into its ``compiler_options``; an option the
    caller also gave with another value is a contradiction."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"ts.jit: {arg}={value!r} must be a bool or None")
    options = dict(jit_kwargs.get("compiler_options") or {})
    for name, want in wanted.items():
        given = options.get(name)
        if given is not None and given != want:
            raise ValueError(
                f"ts.jit: {arg}={value} contradicts compiler_options' {name}={given!r}; "
                "give one of them"
            )
    return {**jit_kwargs, "compiler_options": {**options, **wanted}}


def jit(
    f: Callable | None = None,
    /,
    *,
    capture_graph: bool | None = None,
    deterministic: bool | None = None,
    **jit_kwargs: Any,
):
    """``jax.jit`` with Tessera's trace-time annotation checks.

    Usable as ``@ts.jit``, ``@ts.jit(static_argnames=...)`` or ``ts.jit(f, ...)``.
    Keyword arguments go to ``jax.jit`` (an unknown one raises there).

    At each trace, ``ts.Tensor[...]`` annotations are checked and applied (ranks,
    named dimensions across arguments, storage dtypes, the accumulation policy, the
    return dtype: see tessera_jax/numerics/annotations.py). Functions whose
    parameters carry region privileges are first wrapped by
    ``tessera_jax.sharding.regions``.

    ``capture_graph`` (seed 002's ``@jit(capture_graph=True)``): jit already compiles the
    function into one program launched by one call; on GPUs, ``True`` also compiles it
    with XLA's command buffers on, so that its kernels are recorded into CUDA graphs at
    the first execution and later executions launch the graphs instead of each kernel;
    ``False`` turns them off (each kernel launched on its own); ``None`` keeps XLA's
    default (which, in the XLA of jax 0.11, has them on: ``True`` pins that whatever
    ``XLA_FLAGS`` says). It sets the compile option ``xla_gpu_enable_command_buffer``
    (``ts.graph.command_buffer_options``), merged into ``compiler_options``; CPUs have no
    command buffers, and there it changes nothing. Measured in
    benchmarks/results/graphs-h100.json (benchmarks/graphs.py).

    ``deterministic``: ``True`` compiles with XLA's GPU autotuning off
    (``xla_gpu_deterministic_ops``, see ``_config.deterministic_compile_options``), so the
    same program gives the same bits in every process: autotuning picks kernels by timing,
    and near-ties go either way from one process to the next. It also rounds every bf16
    and f16 value where the program says (``xla_allow_excess_precision`` off), so that
    fusion choices do not change the bits. ``False`` sets both options the other way,
    ``None`` keeps XLA's defaults (unless ``XLA_FLAGS`` says otherwise). The ts
    operators' own kernels and reductions are deterministic either way; this covers the
    GEMMs and fusions XLA compiles around them. The demo's training step uses it. Like
    ``capture_graph``, it is a compile option, which jax takes on the outermost jit only.

    Returns the ``jax.jit`` object (``.lower``, ``.trace``, … work); its signature and
    attributes (``adjoint_graph`` of an ``@ts.autodiff`` function) are ``f``'s. For a
    function with regions, a wrapper that first checks the caller's arguments for
    aliased regions (jit gives every argument its own tracer, so the same array passed
    to two parameters is only visible outside), then calls the ``jax.jit`` object
    (available as ``.jitted``; ``.lower`` is forwarded).
    """
    if capture_graph is not None:
        wanted = command_buffer_options(bool(capture_graph))
        jit_kwargs = _with_option(jit_kwargs, "capture_graph", capture_graph, wanted)
    if deterministic is not None:
        wanted = deterministic_compile_options()
        if not deterministic:
            wanted = {k: not v for k, v in wanted.items()}
        jit_kwargs = _with_option(jit_kwargs, "deterministic", deterministic, wanted)
    if f is None:
        return lambda g: jit(g, **jit_kwargs)
    _check_callable("ts.jit", f)
    if not regions.has_regions(f):
        return jax.jit(_checked(f), **jit_kwargs)
    wrapped = regions.wrap(f)
    jitted = jax.jit(_checked(wrapped), **jit_kwargs)

    @functools.wraps(f)
    def call(*args: Any, **kwargs: Any) -> Any:
        wrapped.check_aliases(*args, **kwargs)
        return jitted(*args, **kwargs)

    call.jitted = jitted
    call.lower = jitted.lower
    return call
