"""Bad arguments to the numerics operators: a TypeError/ValueError naming the function,
the argument and the value, never an IndexError or a NumPy/MLIR/jax-internal message.

One table per module: (id, call, exception type, message fragment).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tessera_jax as ts
from tessera_jax.numerics.context import accumulation
from tessera_jax.primitives.attention import FlashAttentionConfig

X = jnp.ones((3, 4), jnp.float32)
I32 = jnp.ones((3, 4), jnp.int32)
Q = jnp.ones((1, 4, 2, 8), jnp.float32)


def _run(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def _table(cases):
    return pytest.mark.parametrize(
        "call, exc, match", [c[1:] for c in cases], ids=[c[0] for c in cases]
    )


REDUCTIONS = [
    ("sum-x-None", lambda: ts.sum(None), TypeError, r"sum: x=None must be an array"),
    ("sum-x-str", lambda: ts.sum("abc"), TypeError, r"sum: x='abc' must be an array"),
    ("sum-x-bool", lambda: ts.sum(jnp.ones(3, bool)), TypeError, r"sum: x.dtype=bool"),
    ("sum-axis-float", lambda: ts.sum(X, axis=1.0), TypeError, r"sum: axis=1.0 must be None"),
    ("sum-axis-bool", lambda: ts.sum(X, axis=True), TypeError, r"sum: axis=True must be an int"),
    ("sum-axis-str", lambda: ts.sum(X, axis="0"), TypeError, r"sum: axis='0' must be None"),
    ("sum-axis-floats", lambda: ts.sum(X, axis=(0, 1.0)), TypeError, r"sum: axis=1.0 must be"),
    ("sum-axis-range", lambda: ts.sum(X, axis=(0, 5)), ValueError, r"sum: axis=5 is out of range"),
    ("sum-axis-neg", lambda: ts.sum(X, axis=-3), ValueError, r"sum: axis=-3 is out of range"),
    ("sum-axis-repeat", lambda: ts.sum(X, axis=(1, -1)), ValueError, r"sum: .* repeats an axis"),
    ("sum-keepdims", lambda: ts.sum(X, keepdims="yes"), TypeError, r"sum: keepdims='yes' must"),
    ("sum-keepdims-None", lambda: ts.sum(X, keepdims=None), TypeError, r"sum: keepdims=None"),
    ("sum-det-int", lambda: ts.sum(X, deterministic=2), TypeError, r"sum: deterministic=2"),
    ("max-x-None", lambda: ts.max(None), TypeError, r"max: x=None must be an array"),
    ("max-axis-float", lambda: ts.max(X, axis=0.0), TypeError, r"max: axis=0.0 must be None"),
    ("max-axis-range", lambda: ts.max(X, axis=2), ValueError, r"max: axis=2 is out of range"),
    ("max-empty", lambda: ts.max(jnp.ones((0, 3))), ValueError, r"max: cannot reduce a zero-size"),
    ("max-keepdims", lambda: ts.max(X, keepdims=1), TypeError, r"max: keepdims=1 must be a bool"),
    ("mse-pred-None", lambda: ts.mse(None, X), TypeError, r"mse: pred=None must be an array"),
    ("mse-target-None", lambda: ts.mse(X, None), TypeError, r"mse: target=None must be an array"),
    ("mse-shapes", lambda: ts.mse(X, X.T), ValueError, r"mse: pred.shape=\(3, 4\) must equal"),
    ("mse-dtypes", lambda: ts.mse(X, X.astype(jnp.bfloat16)), TypeError, r"mse: pred.dtype"),
    ("mse-int", lambda: ts.mse(I32, I32), TypeError, r"mse: pred.dtype=int32"),
    ("mse-empty", lambda: ts.mse(jnp.ones(0), jnp.ones(0)), ValueError, r"mse: .* no elements"),
]


@_table(REDUCTIONS)
def test_reductions_reject_bad_arguments(call, exc, match):
    _run(call, exc, match)


SOFTMAX = [
    ("softmax-x-None", lambda: ts.softmax(None), TypeError, r"softmax: x=None must be an array"),
    ("softmax-int", lambda: ts.softmax(I32), TypeError, r"softmax: x.dtype=int32"),
    ("softmax-scalar", lambda: ts.softmax(jnp.float32(1)), ValueError, r"softmax: x must have"),
    ("softmax-axis-float", lambda: ts.softmax(X, 1.0), TypeError, r"softmax: axis=1.0 must be"),
    ("softmax-axis-None", lambda: ts.softmax(X, None), TypeError, r"softmax: axis=None must be"),
    ("softmax-axis-bool", lambda: ts.softmax(X, True), TypeError, r"softmax: axis=True must be"),
    ("softmax-axis-range", lambda: ts.softmax(X, 2), ValueError, r"softmax: axis=2 is out of"),
    ("log_softmax-axes", lambda: ts.log_softmax(X, (0, 1)), TypeError, r"log_softmax: axis="),
    ("log_softmax-str", lambda: ts.log_softmax("x"), TypeError, r"log_softmax: x='x' must be"),
]


@_table(SOFTMAX)
def test_softmax_rejects_bad_arguments(call, exc, match):
    _run(call, exc, match)


W = jnp.ones(4)
NORMS = [
    ("rmsnorm-x-None", lambda: ts.rmsnorm(None, W), TypeError, r"rmsnorm: x=None must be an"),
    ("rmsnorm-w-None", lambda: ts.rmsnorm(X, None), TypeError, r"rmsnorm: weight is required"),
    ("rmsnorm-int", lambda: ts.rmsnorm(I32, W), TypeError, r"rmsnorm: x.dtype=int32"),
    ("rmsnorm-scalar", lambda: ts.rmsnorm(jnp.float32(1), W), ValueError, r"rmsnorm: x must"),
    ("rmsnorm-w-shape", lambda: ts.rmsnorm(X, jnp.ones(3)), ValueError, r"weight.shape=\(3,\)"),
    ("rmsnorm-w-rank", lambda: ts.rmsnorm(X, jnp.ones((1, 4))), ValueError, r"weight.shape="),
    ("rmsnorm-w-int", lambda: ts.rmsnorm(X, W.astype(int)), TypeError, r"weight.dtype=int32"),
    ("rmsnorm-eps-neg", lambda: ts.rmsnorm(X, W, eps=-1.0), ValueError, r"rmsnorm: eps=-1.0"),
    ("rmsnorm-eps-zero", lambda: ts.rmsnorm(X, W, eps=0.0), ValueError, r"eps=0.0 must be .* > 0"),
    ("rmsnorm-eps-nan", lambda: ts.rmsnorm(X, W, eps=np.nan), ValueError, r"rmsnorm: eps=nan"),
    ("rmsnorm-eps-str", lambda: ts.rmsnorm(X, W, eps="1"), TypeError, r"rmsnorm: eps='1' must"),
    ("rmsnorm-eps-bool", lambda: ts.rmsnorm(X, W, eps=True), TypeError, r"rmsnorm: eps=True"),
    ("rmsnorm-eps-arr", lambda: ts.rmsnorm(X, W, eps=jnp.float32(1)), TypeError, r"eps=Array"),
    ("safe-eps-neg", lambda: ts.rmsnorm_safe(X, eps=-1e-6), ValueError, r"rmsnorm_safe: eps="),
    ("safe-w-str", lambda: ts.rmsnorm_safe(X, "w"), TypeError, r"rmsnorm_safe: weight='w'"),
    ("layernorm-b-shape", lambda: ts.layernorm(X, None, jnp.ones(5)), ValueError, r"bias.shape"),
    ("layernorm-w-None-x", lambda: ts.layernorm(None, W, W), TypeError, r"layernorm: x=None"),
    ("layernorm-eps-None", lambda: ts.layernorm(X, W, W, eps=None), TypeError, r"eps=None"),
]


@_table(NORMS)
def test_norms_reject_bad_arguments(call, exc, match):
    _run(call, exc, match)


KEY = jax.random.key(0)
CAST = [
    ("cast-x-None", lambda: ts.cast(None, ts.bf16), TypeError, r"cast: x=None must be an array"),
    ("cast-dtype-None", lambda: ts.cast(X, None), TypeError, r"cast: dtype_or_policy=None"),
    ("cast-dtype-name", lambda: ts.cast(X, "fp9"), TypeError, r"cast: dtype_or_policy='fp9'"),
    ("cast-dtype-int", lambda: ts.cast(X, 5), TypeError, r"cast: dtype_or_policy=5"),
    ("cast-complex-real", lambda: ts.cast(X.astype(jnp.complex64), ts.f32), TypeError, r"cast"),
    ("cast-key-int", lambda: ts.cast(X, ts.bf16, key=3), TypeError, r"cast: key must be one"),
    ("cast-key-batch", lambda: ts.cast(X, ts.bf16, key=jax.random.split(KEY)), TypeError, r"key"),
    ("cast-key-f64", lambda: ts.cast(X, ts.f64, key=KEY), TypeError, r"cast: stochastic"),
    ("cast-sr-no-key", lambda: ts.cast(X, ts.bf16 @ ts.stochastic_round), ValueError, r"key="),
]


@_table(CAST)
def test_cast_rejects_bad_arguments(call, exc, match):
    _run(call, exc, match)


@ts.precision_policy
class _Half:
    storage = ts.f16


POLICY = [
    ("quantize-x-None", lambda: ts.quantize(None, ts.int8), TypeError, r"quantize: x=None"),
    ("quantize-x-int", lambda: ts.quantize(I32, ts.int8), TypeError, r"quantize: x.dtype=int32"),
    ("quantize-policy-None", lambda: ts.quantize(X, None), TypeError, r"quantize: policy=None"),
    ("quantize-policy-str", lambda: ts.quantize(X, "nope"), TypeError, r"quantize: policy='nope'"),
    ("quantize-complex", lambda: ts.quantize(X, ts.complex64), TypeError, r"storage=ts.complex64"),
    ("quantize-key-int", lambda: ts.quantize(X, ts.int8, key=5), TypeError, r"quantize: key must"),
    (
        "quantize-sr-no-key",
        lambda: ts.quantize(X, ts.fp8_e4m3 @ ts.stochastic_round),
        ValueError,
        r"quantize: the policy rounds stochastically",
    ),
    ("dequantize-array", lambda: ts.dequantize(X), TypeError, r"dequantize: expected a Quantized"),
    ("compose-int", lambda: ts.bf16 @ 3, TypeError, r"policy composition: cannot apply 3"),
    ("compose-dtype", lambda: ts.bf16 @ ts.f32, TypeError, r"policy composition: cannot apply"),
    ("compose-order", lambda: ts.accum(ts.f32) @ ts.bf16, TypeError, r"starts with its storage"),
    ("compose-sr-first", lambda: ts.stochastic_round @ ts.bf16, TypeError, r"starts with its"),
    ("accum-None", lambda: ts.accum(None), TypeError, r"accum: dtype=None"),
    ("accum-name", lambda: ts.accum("fp9"), TypeError, r"accum: dtype='fp9'"),
    ("loss_scale-neg", lambda: ts.loss_scale(-1), ValueError, r"loss_scale: scale=-1.0 must"),
    ("loss_scale-inf", lambda: ts.loss_scale(np.inf), ValueError, r"loss_scale: scale=inf must"),
    ("loss_scale-str", lambda: ts.loss_scale("a"), TypeError, r"loss_scale: scale='a' must"),
    ("loss_scale-None", lambda: ts.loss_scale(None), TypeError, r"loss_scale: scale=None must"),
    ("loss_scale-bool", lambda: ts.loss_scale(True), TypeError, r"loss_scale: scale=True must"),
    ("policy-function", lambda: ts.precision_policy(len), TypeError, r"decorates a class"),
    (
        "policy-complex-storage",
        lambda: ts.precision_policy(type("P", (), {"storage": ts.complex64})),
        TypeError,
        r"precision_policy P: .*storage=ts.complex64 must be a float or integer format",
    ),
    (
        "policy-no-storage",
        lambda: ts.precision_policy(type("P", (), {})),
        TypeError,
        r"precision_policy P: define the class attribute storage",
    ),
    (
        "policy-bad-storage",
        lambda: ts.precision_policy(type("P", (), {"storage": "fp9"})),
        TypeError,
        r"precision_policy P: storage='fp9'",
    ),
    (
        "policy-int-compute",
        lambda: ts.precision_policy(type("P", (), {"storage": ts.int8, "compute": ts.int32})),
        TypeError,
        r"precision_policy P: .* must be floats",
    ),
    (
        "policy-half-methods",
        lambda: ts.precision_policy(
            type("P", (), {"storage": ts.int8, "quantize": lambda self, x: x})
        ),
        TypeError,
        r"precision_policy P: define both quantize",
    ),
    ("accumulation-int16", lambda: accumulation(np.int16).__enter__(), ValueError, r"accumulat"),
    ("accumulation-name", lambda: accumulation("fp9").__enter__(), TypeError, r"accumulation"),
]


@_table(POLICY)
def test_policies_and_quantize_reject_bad_arguments(call, exc, match):
    _run(call, exc, match)


ELEMENTWISE = [
    *[
        (f"{name}-None", lambda f=f: f(None), TypeError, rf"{name}: x=None must be an array")
        for name, f in [("relu", ts.relu), ("gelu", ts.gelu), ("exp", ts.exp), ("tanh", ts.tanh)]
    ],
    *[
        (f"{name}-int", lambda f=f: f(I32), TypeError, rf"{name}: x.dtype=int32 is not supported")
        for name, f in [("sqrt", ts.sqrt), ("abs", ts.abs), ("round", ts.round), ("relu", ts.relu)]
    ],
    ("abs-bool", lambda: ts.abs(jnp.ones(3, bool)), TypeError, r"abs: x.dtype=bool"),
    ("round-complex", lambda: ts.round(X.astype(jnp.complex64)), TypeError, r"round: x.dtype="),
    ("gelu-approximate", lambda: ts.gelu(X, approximate=1), TypeError, r"gelu: approximate=1"),
    ("relu-str", lambda: ts.relu("x"), TypeError, r"relu: x='x' must be an array"),
]


@_table(ELEMENTWISE)
def test_elementwise_rejects_bad_arguments(call, exc, match):
    _run(call, exc, match)


FFT = [
    ("fft-None", lambda: ts.fft(None), TypeError, r"fft: x=None must be an array"),
    ("fft-int", lambda: ts.fft(I32), TypeError, r"fft: x.dtype=int32 is not supported"),
    ("fft-scalar", lambda: ts.fft(jnp.float32(1)), ValueError, r"fft: x must have at least"),
    ("fft-axis-float", lambda: ts.fft(X, axis=1.0), TypeError, r"fft: axis=1.0 must be an int"),
    ("fft-axis-None", lambda: ts.fft(X, axis=None), TypeError, r"fft: axis=None must be an int"),
    ("ifft-axis-range", lambda: ts.ifft(X, axis=2), ValueError, r"ifft: axis=2 is out of range"),
    ("ifft-empty", lambda: ts.ifft(jnp.ones((0, 3)), 0), ValueError, r"ifft: x.shape\[0\]=0"),
]


@_table(FFT)
def test_fft_rejects_bad_arguments(call, exc, match):
    _run(call, exc, match)


def _fa(q=Q, k=Q, v=Q, **kw):
    return lambda: ts.flash_attention(q, k, v, **kw)


ATTENTION = [
    ("q-None", _fa(q=None), TypeError, r"flash_attention: q=None must be an array"),
    ("rank", _fa(q=X, k=X, v=X), ValueError, r"q.shape=\(3, 4\) must have rank 4"),
    ("heads", _fa(k=jnp.ones((1, 4, 3, 8)), v=jnp.ones((1, 4, 3, 8))), ValueError, r"multiple"),
    ("kv-shapes", _fa(v=jnp.ones((1, 5, 2, 8))), ValueError, r"k.shape=.* must equal v.shape"),
    ("batch", _fa(k=jnp.ones((2, 4, 2, 8)), v=jnp.ones((2, 4, 2, 8))), ValueError, r"batch"),
    ("head_dim", _fa(k=jnp.ones((1, 4, 2, 4)), v=jnp.ones((1, 4, 2, 4))), ValueError, r"head_dim"),
    ("dtype-mix", _fa(k=Q.astype(jnp.bfloat16)), TypeError, r"q.dtype=float32, k.dtype=bfloat16"),
    ("dtype-int", _fa(*[Q.astype(jnp.int32)] * 3), TypeError, r"q.dtype=int32 is not supported"),
    ("causal-None", _fa(causal=None), TypeError, r"flash_attention: causal=None must be a bool"),
    ("scale-array", _fa(scale=jnp.float32(1)), TypeError, r"scale=Array.* must be a Python"),
    ("scale-neg", _fa(scale=-1.0), ValueError, r"scale=-1.0 must be a positive finite"),
    ("config-tuple", _fa(config=(64, 64)), TypeError, r"config=\(64, 64\) must be a Flash"),
    ("config-neg", lambda: FlashAttentionConfig(block_q=-1), ValueError, r"block_q=-1 must be"),
    ("config-float", lambda: FlashAttentionConfig(block_kv=1.5), TypeError, r"block_kv=1.5"),
]


@_table(ATTENTION)
def test_flash_attention_rejects_bad_arguments(call, exc, match):
    _run(call, exc, match)


def _loss(a, b=1.0):
    return jnp.sum(a * b)


AUTODIFF = [
    ("grad-f-int", lambda: ts.grad(3), TypeError, r"ts.grad: expected a function, got a int"),
    ("argnums-neg", lambda: ts.grad(_loss, argnums=-5)(X), ValueError, r"argnums=-5 is out of"),
    ("argnums-big", lambda: ts.grad(_loss, argnums=5)(X), ValueError, r"argnums=5 is out of"),
    ("argnums-float", lambda: ts.grad(_loss, argnums=1.0), TypeError, r"argnums=1.0 must be an"),
    ("argnums-bool", lambda: ts.grad(_loss, argnums=True), TypeError, r"argnums=True must be"),
    ("argnums-empty", lambda: ts.grad(_loss, argnums=()), TypeError, r"argnums=\(\) must be"),
    ("argnums-None", lambda: ts.grad(_loss, argnums=None), TypeError, r"argnums=None must be"),
    ("argnums-str", lambda: ts.grad(_loss, argnums="a"), TypeError, r"argnums='a' must be"),
    ("argnums-dup", lambda: ts.grad(_loss, argnums=(0, 0)), ValueError, r"repeats a position"),
    ("argnums-alias", lambda: ts.grad(_loss, argnums=(0, -2))(X, X), ValueError, r"twice"),
    ("wrt-int", lambda: ts.grad(_loss, wrt=1), TypeError, r"ts.grad: wrt=1 must be a parameter"),
    ("wrt-empty", lambda: ts.grad(_loss, wrt=()), TypeError, r"ts.grad: wrt=\(\) must be"),
    ("wrt-unknown", lambda: ts.grad(_loss, wrt="c"), ValueError, r"wrt='c' is not a parameter"),
    ("wrt-twice", lambda: ts.grad(_loss, wrt=("a", "a")), ValueError, r"names a parameter twice"),
    ("wrt-and-argnums", lambda: ts.grad(_loss, 1, wrt="a"), ValueError, r"either wrt= or"),
    ("wrt-missing-arg", lambda: ts.grad(_loss, wrt="a")(), TypeError, r"ts.grad: _loss: "),
    ("has_aux-int", lambda: ts.grad(_loss, has_aux=1), TypeError, r"has_aux=1 must be a bool"),
    ("has_aux-not-pair", lambda: ts.grad(_loss, has_aux=True)(X), TypeError, r"not a \(loss, "),
    ("output-vector", lambda: ts.grad(lambda a: a)(X), TypeError, r"must return a scalar float"),
    ("output-int", lambda: ts.grad(lambda a: 1)(X), TypeError, r"dtype int32"),
    ("input-int", lambda: ts.grad(_loss)(I32), TypeError, r"argument 0 of _loss has dtype int32"),
    ("loss_scale-zero", lambda: ts.grad(_loss, loss_scale=0), ValueError, r"scale=0.0 must be"),
    ("loss_scale-bool", lambda: ts.grad(_loss, loss_scale=True), TypeError, r"loss_scale=True"),
    ("loss_scale-str", lambda: ts.grad(_loss, loss_scale="8"), TypeError, r"loss_scale='8'"),
    ("loss_scale-vec", lambda: ts.grad(_loss, loss_scale=jnp.ones(2)), TypeError, r"scalar"),
    ("loss_scale-dtype", lambda: ts.grad(_loss, loss_scale=ts.bf16), TypeError, r"loss_scale="),
    ("vag-argnums", lambda: ts.value_and_grad(_loss, -3)(X), ValueError, r"ts.value_and_grad"),
    ("vag-wrt", lambda: ts.value_and_grad(_loss, wrt=0), TypeError, r"ts.value_and_grad: wrt=0"),
    ("autodiff-int", lambda: ts.autodiff(3), TypeError, r"ts.autodiff: expected a function"),
    ("vjp-int", lambda: ts.custom_vjp(3), TypeError, r"ts.custom_vjp: expected a function"),
    (
        "vjp-nondiff-float",
        lambda: ts.custom_vjp(_loss, nondiff_argnums=1.0),
        TypeError,
        r"ts.custom_vjp: nondiff_argnums=1.0 must be",
    ),
    (
        "vjp-nondiff-range",
        lambda: ts.custom_vjp(_loss, nondiff_argnums=(5,)),
        ValueError,
        r"ts.custom_vjp: nondiff_argnums=\(5,\) names position 5",
    ),
    (
        "jvp-nondiff-str",
        lambda: ts.custom_jvp(_loss, nondiff_argnums="a"),
        TypeError,
        r"ts.custom_jvp: nondiff_argnums='a'",
    ),
    (
        "jvp-nondiff-names",
        lambda: ts.custom_jvp(_loss, nondiff_argnames=3),
        TypeError,
        r"ts.custom_jvp: nondiff_argnames=3",
    ),
    (
        "vjp-no-rule",
        lambda: ts.custom_vjp(_loss)(X),
        TypeError,
        r"ts.custom_vjp: _loss has no derivative rule yet; define it with _loss.defvjp",
    ),
    (
        "jvp-no-rule",
        lambda: ts.custom_jvp(_loss)(X),
        TypeError,
        r"ts.custom_jvp: _loss has no derivative rule yet; define it with _loss.defjvp",
    ),
    ("vjp-defvjp-int", lambda: ts.custom_vjp(_loss).defvjp(1, 2), TypeError, r"defvjp: expected"),
    ("jvp-defjvps-int", lambda: ts.custom_jvp(_loss).defjvps(1), TypeError, r"tangent_fns\[0\]=1"),
    ("jit-int", lambda: ts.jit(3), TypeError, r"ts.jit: expected a function, got a int"),
    ("jit-capture", lambda: ts.jit(_loss, capture_graph=1), TypeError, r"capture_graph=1 must be"),
]


@_table(AUTODIFF)
def test_autodiff_rejects_bad_arguments(call, exc, match):
    _run(call, exc, match)


ANNOTATIONS = [
    ("tensor-new", lambda: ts.Tensor(), TypeError, r"ts.Tensor is an annotation"),
    ("dim-neg", lambda: ts.Tensor["a", -1], ValueError, r"ts.Tensor: dimension size -1"),
    ("dim-float", lambda: ts.Tensor["a", 1.0], TypeError, r"ts.Tensor: 1.0 is neither"),
    ("dim-bool", lambda: ts.Tensor[True], TypeError, r"ts.Tensor: True is neither"),
    ("dim-empty", lambda: ts.Tensor["", "b"], ValueError, r"dimension name must not be empty"),
    ("numerics-None", lambda: ts.Tensor["a", None], TypeError, r"ts.Tensor: None is not a dtype"),
    ("numerics-accum", lambda: ts.Tensor["a", ts.accum(ts.f32)], TypeError, r"not a dtype"),
    ("dtype-first", lambda: ts.Tensor[ts.f32, "a"], TypeError, r"only the last item may be"),
    ("two-ellipses", lambda: ts.Tensor[..., ...], ValueError, r"at most one \.\.\."),
    ("kernel_mode-name", lambda: ts.kernel_mode("fast").__enter__(), ValueError, r"mode='fast'"),
    ("kernel_mode-None", lambda: ts.kernel_mode(None).__enter__(), ValueError, r"mode=None"),
    ("set_kernel_mode", lambda: ts.set_kernel_mode(1), ValueError, r"set_kernel_mode: mode=1"),
]


@_table(ANNOTATIONS)
def test_annotations_and_config_reject_bad_arguments(call, exc, match):
    _run(call, exc, match)


def test_annotated_function_rejects_mismatched_arguments():
    # Dimension names are strings, which ruff reads as forward references.
    @ts.jit
    def f(a: ts.Tensor["M", "K", ts.f32], b: ts.Tensor["K", "N", ts.f32]):  # noqa: F821
        return a @ b

    with pytest.raises(TypeError, match=r'f: dimension "K" is 4 in a.shape\[1\] but 3'):
        f(X, X)
    with pytest.raises(TypeError, match=r"f: a has dtype int32 but its annotation"):
        f(I32, X.T)
    with pytest.raises(TypeError, match=r"f: a has rank 1"):
        f(jnp.ones(3), X)
    with pytest.raises(TypeError, match=r"f: the arguments do not match its signature"):
        f(X)


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda x: ts.sum(x, axis=1.0), r"sum: axis=1.0"),
        (lambda x: ts.softmax(x, axis=2), r"softmax: axis=2 is out of range"),
        (lambda x: ts.rmsnorm(x, jnp.ones(3)), r"rmsnorm: weight.shape"),
        (lambda x: ts.cast(x, None), r"cast: dtype_or_policy=None"),
        (lambda x: ts.quantize(x, "nope").values, r"quantize: policy='nope'"),
    ],
    ids=["sum", "softmax", "rmsnorm", "cast", "quantize"],
)
def test_errors_are_raised_at_trace_time_under_jit_and_vmap(fn, match):
    with pytest.raises((TypeError, ValueError), match=match):
        jax.jit(fn)(X)
    with pytest.raises((TypeError, ValueError), match=match):
        jax.vmap(fn)(X[None])
