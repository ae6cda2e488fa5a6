"""A checkpoint's `quantization_config` read into the model config's fields: which quantized format
its weights are in (GPT-OSS's MXFP4 experts, `mxfp4.py`; FP8 weights, `fp8.py`, as `fp8` stores
them or as compressed-tensors does, llm-compressor's FP8 releases; 4- and 8-bit integer weights as
compressed-tensors packs them, its W4A16 and W8A16 releases, `int_weights.py`, or 4-bit ones as
AutoAWQ's GEMM format does, `awq.py`), FP8's scale blocks or the integers' scheme, and the modules
it stores unquantized; anything else is refused naming the field."""
from __future__ import annotations

import re

from splitserve.engine import awq
from splitserve.engine.config_error import ConfigError, positive_int
from splitserve.engine.int_weights import BITS, IntWeights

COMMON_METHODS = ("fp8", "compressed-tensors", "awq")  # the quant_methods served for every architecture but these:
METHODS = {"GptOssForCausalLM": ("mxfp4",)}
FP8_STRATEGIES = ("tensor", "channel", "block")  # compressed-tensors' weight scales: one, one a row, one a block
COMPRESSED_FORMATS = ("float-quantized", "naive-quantized")  # compressed-tensors' formats of FP8 weights
PACKED_FORMAT = "pack-quantized"  # compressed-tensors' format of integer weights packed into int32
INT_STRATEGIES = ("group", "channel")  # integer weights' scales: one a group of a row's columns, one a row
MXFP4_GROUP = 32  # values a scale covers (mxfp4.GROUP)
MAX_PATTERNS = 4096  # of a quantization_config's modules_to_not_convert (or compressed-tensors' ignore)


def stored_unquantized(patterns: tuple[str, ...], module: str) -> bool:
    """Whether a pattern of `patterns` (regular expressions) names module `module`
    ("model.layers.0.self_attn.q_proj"): it matches from the start up to a module boundary
    ("model.layers.0" or "model.layers.*.mlp", not "model.layers.1" for layer 10), or ends it."""
    return any(re.match(f"(?:{p})(?=\\.|$)", module) or module.endswith(p) for p in patterns)


def parse_quantization(cfg: dict, arch: str, source: str) -> dict:
    """The quantization fields: the quant_method of a quantized checkpoint, which loads only in a
    format `METHODS` lists for its architecture, and FP8's weight_block_size and modules
    stored unquantized; none for an unquantized checkpoint."""
    quant = cfg.get("quantization_config")
    if quant is None:
        return {}
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    supported = METHODS.get(arch, COMMON_METHODS)
    if method not in supported:
        raise ConfigError(f"{source}: quantization_config quant_method {method!r} is not supported for {arch} "
                          f"(supported: {', '.join(supported)}); serve the unquantized checkpoint")
    if method == "fp8":
        return dict(quantization=method, weight_block_size=_fp8_block(quant, source),
                    unquantized_modules=_patterns(quant, "modules_to_not_convert", source))
    if method == "compressed-tensors":
        return _compressed(quant, source)
    if method == "awq":
        return _awq(quant, source)
    for name in ("hidden_size", "intermediate_size"):  # MXFP4 (GPT-OSS): the experts' inputs and width
        if int(cfg.get(name) or 0) % MXFP4_GROUP:
            raise ConfigError(f"{source}: {name}={cfg.get(name)} is not a multiple of {MXFP4_GROUP}, "
                              "MXFP4's group of values")
    return dict(quantization=method)


def _patterns(quant: dict, name: str, source: str) -> tuple[str, ...]:
    """A list of module-name patterns (regular expressions), each checked."""
    patterns = quant.get(name) or []
    if not isinstance(patterns, list) or len(patterns) > MAX_PATTERNS or not all(isinstance(p, str) for p in patterns):
        raise ConfigError(f"{source}: quantization_config {name} must be a list of at most {MAX_PATTERNS} strings")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"{source}: quantization_config {name} {pattern!r} is not a regular expression "
                              f"({exc})") from exc
    return tuple(patterns)


def _compressed(quant: dict, source: str) -> dict:
    """A compressed-tensors checkpoint's fields where its weights are FP8 (e4m3, symmetric: one
    scale a tensor, a row or a block, `weight_scale`) or packed integers (`int_weights`) in every
    Linear but those it ignores; other schemes (NVFP4, sparsity, transforms) are refused naming
    what differs. An FP8 activation scheme is not used (activations stay in the serving dtype);
    integer activations (W8A8) are refused."""
    where = f"{source}: quantization_config"
    for key, allowed in (("quantization_status", ("compressed",)), ("sparsity_config", (None, {})),
                         ("transform_config", (None, {}))):
        if quant.get(key, allowed[0]) not in allowed:
            raise ConfigError(f"{where} {key} {quant[key]!r} is not supported (compressed weights only)")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{where} config_groups must be a non-empty object")
    schemes = set()
    for name, group in groups.items():
        at = f"{where} config_groups.{name}"
        if not isinstance(group, dict) or group.get("targets") != ["Linear"]:
            raise ConfigError(f"{at} targets must be [\"Linear\"] (every projection), got "
                              f"{group.get('targets') if isinstance(group, dict) else group!r}")
        form = group.get("format") or quant.get("format")
        if form not in (*COMPRESSED_FORMATS, PACKED_FORMAT):
            raise ConfigError(f"{at} format {form!r} is not supported (FP8 weights: {', '.join(COMPRESSED_FORMATS)}; "
                              f"integer weights: {PACKED_FORMAT})")
        if group.get("output_activations") is not None:
            raise ConfigError(f"{at} output_activations are not supported")
        weights = f"quantization_config.config_groups.{name}.weights"
        if form == PACKED_FORMAT:
            if group.get("input_activations") is not None:
                raise ConfigError(f"{at} input_activations: quantized activations (W8A8) are not supported; "
                                  "integer weights with activations in the serving dtype (W4A16, W8A16) are")
            schemes.add(_int_weights(group.get("weights"), weights, source))
        else:
            schemes.add(_fp8_weights(group.get("weights"), weights, source))
    if len(schemes) > 1:
        raise ConfigError(f"{where} config_groups quantize weights differently: {sorted(schemes, key=str)}")
    ignore = quant.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise ConfigError(f"{where} ignore must be a list of module names and 're:' patterns")
    patterns = [p[3:] if p.startswith("re:") else re.escape(p) for p in ignore]
    scheme = schemes.pop()
    fields = (dict(quantization="int", int_weights=scheme) if isinstance(scheme, IntWeights)
              else dict(quantization="fp8", weight_block_size=scheme))
    return dict(**fields, unquantized_modules=_patterns({"ignore": patterns}, "ignore", source))


def _awq(quant: dict, source: str) -> dict:
    """AutoAWQ's GEMM checkpoints: 4 bits, a scale a group of `group_size` columns, zero points
    unless `zero_point` is false; its `modules_to_not_convert` are stored unquantized (AutoAWQ's
    rule: every module whose name contains one). Its other kernels' layouts (GEMV, Marlin, ExLlama)
    are refused."""
    where = f"{source}: quantization_config"
    version = quant.get("version", "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        raise ConfigError(f"{where} version {version!r} is not supported (AutoAWQ's gemm layout is)")
    if quant.get("bits", awq.BITS) != awq.BITS:
        raise ConfigError(f"{where} bits {quant['bits']!r} is not supported (AutoAWQ packs {awq.BITS}-bit weights)")
    zero_point = quant.get("zero_point", True)
    if not isinstance(zero_point, bool):
        raise ConfigError(f"{where} zero_point must be true or false, got {zero_point!r}")
    group = positive_int(quant.get("group_size", 128), "quantization_config.group_size", source)
    names = _patterns({"modules_to_not_convert": [re.escape(m) for m in quant.get("modules_to_not_convert") or []
                                                  if isinstance(m, str)]}, "modules_to_not_convert", source)
    if len(names) != len(quant.get("modules_to_not_convert") or []):
        raise ConfigError(f"{where} modules_to_not_convert must be a list of module names")
    return dict(quantization="int", int_weights=IntWeights(awq.BITS, group, not zero_point), int_layout="awq",
                unquantized_modules=tuple(f".*{name}.*" for name in names))


def _int_weights(weights, name: str, source: str) -> IntWeights:
    """A packed integer weight scheme: 4 or 8 bits, one scale a group of columns or a row,
    symmetric or with zero points; the order GPTQ calibrated in does not change the format (its
    `actorder: weight`), a per-column group index (`group`) is refused."""
    at = f"{source}: {name}"
    if not isinstance(weights, dict):
        raise ConfigError(f"{at} must be an object")
    if weights.get("type") != "int" or weights.get("num_bits") not in BITS or weights.get("dynamic", False):
        raise ConfigError(f"{at}: {weights.get('num_bits')}-bit {weights.get('type')} weights are not supported "
                          f"in {PACKED_FORMAT} (integers of {' or '.join(map(str, BITS))} bits, static)")
    strategy = weights.get("strategy")
    if strategy not in INT_STRATEGIES:
        raise ConfigError(f"{at}.strategy {strategy!r} is not supported (supported: {', '.join(INT_STRATEGIES)})")
    if weights.get("actorder") not in (None, "weight", "static"):
        raise ConfigError(f"{at}.actorder {weights['actorder']!r} is not supported (a group index per column); "
                          "weight or null is")
    symmetric = weights.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise ConfigError(f"{at}.symmetric must be true or false, got {symmetric!r}")
    group = positive_int(weights.get("group_size"), f"{name}.group_size", source) if strategy == "group" else None
    return IntWeights(weights["num_bits"], group, symmetric)


def _fp8_weights(weights, name: str, source: str) -> tuple[int, int] | None:
    """The block of an FP8 weight scheme's scales (None: one a tensor or a row, as their shapes say)."""
    at = f"{source}: {name}"
    if not isinstance(weights, dict):
        raise ConfigError(f"{at} must be an object (weights unquantized are not a compressed FP8 checkpoint)")
    expected = {"num_bits": 8, "type": "float", "symmetric": True}
    for key, value in expected.items():
        if weights.get(key, value) != value:
            raise ConfigError(f"{at}.{key} {weights[key]!r} is not supported (FP8 weights: num_bits 8, type "
                              "float, symmetric)")
    strategy = weights.get("strategy")
    if strategy not in FP8_STRATEGIES:
        raise ConfigError(f"{at}.strategy {strategy!r} is not supported (supported: {', '.join(FP8_STRATEGIES)})")
    if strategy != "block":
        return None
    block = weights.get("block_structure")
    if not isinstance(block, list) or len(block) != 2:
        raise ConfigError(f"{at}.block_structure must be [rows, cols], got {block!r}")
    return (positive_int(block[0], f"{name}.block_structure[0]", source),
            positive_int(block[1], f"{name}.block_structure[1]", source))


def _fp8_block(quant: dict, source: str) -> tuple[int, int] | None:
    """FP8's weight_block_size (null or absent: one scale a tensor); its weights are float8 e4m3."""
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{source}: quantization_config fmt {quant['fmt']!r} is not supported (FP8 e4m3 only)")
    block = quant.get("weight_block_size")
    if block is None:
        return None
    if not isinstance(block, list) or len(block) != 2:
        raise ConfigError(f"{source}: quantization_config weight_block_size must be [rows, cols], got {block!r}")
    return (positive_int(block[0], "quantization_config.weight_block_size[0]", source),
            positive_int(block[1], "quantization_config.weight_block_size[1]", source))
