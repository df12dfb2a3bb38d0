"""What the API server checks before it stores a Job: decoding, defaulting and validation.

Three stages, in the API server's order, so a test gets the error a real cluster would give:

1. **Decoding** against the Kubernetes 1.33 OpenAPI schema (``kubernetes-validate``'s strict copy of it): a wrong
   type is a 400 ``BadRequest``; a field the schema marks required is a 422 ``Invalid``; a malformed quantity is
   the 400 the quantity decoder gives. Unknown fields follow the request's ``fieldValidation``, whose default is
   ``Warn`` since 1.27 (apiserver ``handlers/create.go``; kubernetes.io "API Concepts", field validation):
   ``Warn`` drops them and answers one ``Warning`` header each (``unknown field "spec.x"``), ``Ignore`` drops
   them silently, ``Strict`` refuses the object with a 400 ``strict decoding error: unknown field "spec.x"``; any
   other value is a 422 from ``ValidateCreateOptions``. (``kubectl`` sends ``Strict``; the ``kubernetes`` Python
   client sends nothing unless asked, so it gets ``Warn``.)
2. **Defaulting** (``pkg/apis/batch/v1/defaults.go``, ``pkg/apis/core/v1/defaults.go``): ``backoffLimit``,
   ``completionMode``, ``podReplacementPolicy``, the pod template's defaults, ...
3. **Validation** (``pkg/apis/batch/validation``, ``pkg/apis/core/validation``): the field rules a backend can
   break, worded exactly like the real messages and collected into one 422 ``Invalid`` ``Status``.

The schema is stricter than the server in one place: it marks ``onPodConditions[].status`` required, where the
server would default it to ``"True"``; the emulator follows the schema (so does ``kubectl``'s client-side check).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from .kube_errors import (
    OMIT,
    ApiError,
    FieldError,
    FieldErrors,
    bad_request,
    duplicate,
    go_quote,
    invalid,
    invalid_object,
    not_supported,
    required,
    too_many,
)

SCHEMA_VERSION = "1.33.0"
MAX_INT32 = 2147483647

# ---------------------------------------------------------------------------------------------------- formats

_DNS1123_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = _DNS1123_LABEL + "(\\." + _DNS1123_LABEL + ")*"
_LABEL_KEY_NAME = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_LABEL_VALUE = "(" + _LABEL_KEY_NAME + ")?"


def _regex_error(message: str, fmt: str, *examples: str) -> str:
    """``validation.RegexError``: the message, the examples and the regular expression."""
    if not examples:
        return f"{message} (regex used for validation is '{fmt}')"
    listed = " or ".join(f"'{e}', " for e in examples)
    return f"{message} (e.g. {listed}regex used for validation is '{fmt}')"


def _max_len(limit: int) -> str:
    return f"must be no more than {limit} characters"


def dns1123_label_errors(value: str) -> list[str]:
    """``validation.IsDNS1123Label``."""
    errors = [_max_len(63)] if len(value) > 63 else []
    if not re.fullmatch(_DNS1123_LABEL, value):
        errors.append(_regex_error("a lowercase RFC 1123 label must consist of lower case alphanumeric characters "
                                   "or '-', and must start and end with an alphanumeric character",
                                   _DNS1123_LABEL, "my-name", "123-abc"))
    return errors


def dns1123_subdomain_errors(value: str) -> list[str]:
    """``validation.IsDNS1123Subdomain`` (object names of Jobs, service accounts, namespaces' prefixes)."""
    errors = [_max_len(253)] if len(value) > 253 else []
    if not re.fullmatch(_DNS1123_SUBDOMAIN, value):
        errors.append(_regex_error("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                                   "characters, '-' or '.', and must start and end with an alphanumeric character",
                                   _DNS1123_SUBDOMAIN, "example.com"))
    return errors


def label_key_errors(key: str) -> list[str]:
    """``validation.IsQualifiedName``: an optional DNS subdomain prefix and a name of at most 63 characters."""
    message = "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an " \
              "alphanumeric character"
    parts = key.split("/")
    errors: list[str] = []
    if len(parts) > 2:
        return ["a valid label key " + _regex_error(message, _LABEL_KEY_NAME, "MyName", "my.name", "123-abc")
                + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"]
    name = parts[-1]
    if len(parts) == 2:
        if not parts[0]:
            errors.append("prefix part must be non-empty")
        else:
            errors.extend("prefix part " + e for e in dns1123_subdomain_errors(parts[0]))
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > 63:
        errors.append("name part " + _max_len(63))
    if not re.fullmatch(_LABEL_KEY_NAME, name):
        errors.append("name part " + _regex_error(message, _LABEL_KEY_NAME, "MyName", "my.name", "123-abc"))
    return errors


def label_value_errors(value: str) -> list[str]:
    """``validation.IsValidLabelValue``."""
    errors = [_max_len(63)] if len(value) > 63 else []
    if not re.fullmatch(_LABEL_VALUE, value):
        errors.append(_regex_error("a valid label must be an empty string or consist of alphanumeric characters, "
                                   "'-', '_' or '.', and must start and end with an alphanumeric character",
                                   _LABEL_VALUE, "MyValue", "my_value", "12345"))
    return errors


def validate_labels(labels: dict[str, str] | None, path: str, errors: FieldErrors) -> None:
    """``ValidateLabels``: every key a qualified name, every value a label value."""
    for key, value in (labels or {}).items():
        errors.add(*(invalid(path, key, m) for m in label_key_errors(key)))
        errors.add(*(invalid(path, value, m) for m in label_value_errors(value)))


# ---------------------------------------------------------------------------------------------------- quantities

_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
QUANTITY_FORMAT_ERROR = ("quantities must match the regular expression "
                         "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
            "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
            "P": Decimal("1e15"), "E": Decimal("1e18")}


class QuantityError(ValueError):
    """A string the quantity decoder rejects (the API server answers 400 before any validation)."""


def parse_quantity(raw: str | int | float) -> tuple[Decimal, str]:
    """A resource quantity as (value, format) where format is ``BinarySI``, ``DecimalSI`` or ``DecimalExponent``."""
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return Decimal(str(raw)), "DecimalSI"
    match = _QUANTITY.match(str(raw).strip())
    if not match:
        raise QuantityError(QUANTITY_FORMAT_ERROR)
    number, suffix = match.groups()
    try:
        mantissa = Decimal(number)
    except InvalidOperation as exc:
        raise QuantityError("unable to parse numeric part of quantity") from exc
    if suffix in _BINARY:
        return mantissa * _BINARY[suffix], "BinarySI"
    if suffix in _DECIMAL:
        return mantissa * _DECIMAL[suffix], "DecimalSI"
    exponent = re.fullmatch(r"[eE]([-+]?[0-9]+)", suffix)
    if exponent:
        return mantissa * Decimal(10) ** int(exponent.group(1)), "DecimalExponent"
    raise QuantityError("unable to parse quantity's suffix")


def canonical_quantity(value: Decimal, fmt: str) -> str:
    """``Quantity.String()``: the largest suffix that keeps an integer mantissa (``1000m`` -> ``1``)."""
    if fmt == "BinarySI" and value == value.to_integral_value() and abs(value) >= 1024:
        for suffix, scale in sorted(_BINARY.items(), key=lambda kv: -kv[1]):
            if value % scale == 0:
                return f"{int(value / scale)}{suffix}"
    for suffix, scale in sorted(_DECIMAL.items(), key=lambda kv: -kv[1]):
        scaled = value / scale
        if scaled == scaled.to_integral_value():
            return f"{int(scaled)}{suffix}"
    return f"{int((value * Decimal('1e9')).to_integral_value())}n"


# ---------------------------------------------------------------------------------------------------- decoding

@functools.lru_cache(maxsize=1)
def _schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """The Job schema and the shared definitions of Kubernetes 1.33, strict variant (no unknown fields)."""
    import importlib.resources

    base = importlib.resources.files("kubernetes_validate").joinpath(
        f"kubernetes-json-schema/v{SCHEMA_VERSION}-local-strict")
    job = json.loads(base.joinpath("job-batch-v1.json").read_text())
    definitions = json.loads(base.joinpath("_definitions.json").read_text())
    return job, definitions


@functools.lru_cache(maxsize=1)
def _validator() -> Any:
    """A JSON-schema validator for Jobs; ``kubernetes-validate`` ships the schema, ``jsonschema`` checks it."""
    import jsonschema
    import referencing
    import referencing.jsonschema

    job, definitions = _schema()
    registry = referencing.Registry().with_resources([
        (definitions["$id"], referencing.Resource.from_contents(definitions)),
        ("https://kubernetes.io/api/job-batch-v1.json", referencing.Resource.from_contents(job)),
    ])
    return jsonschema.Draft202012Validator(job, registry=registry)


def _definition(node: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """Follow a ``$ref`` into the definitions; also return the Go type's short name (``JobSpec``)."""
    ref = node.get("$ref")
    if not ref:
        return node, None
    name = ref.rsplit("/", 1)[-1]
    return _schema()[1]["$defs"][name], name.rsplit(".", 1)[-1]


def _walk(path: list[str | int]) -> list[tuple[dict[str, Any], str | None, bool]]:
    """Each step of ``path`` through the schema: (schema node, enclosing Go struct, whether it is a map key)."""
    node, struct = _schema()[0], "Job"
    steps: list[tuple[dict[str, Any], str | None, bool]] = []
    for part in path:
        is_map_key = False
        if isinstance(part, int):
            child = node.get("items", {})
        elif part in node.get("properties", {}):
            child = node["properties"][part]
        else:
            child, is_map_key = node.get("additionalProperties") or {}, True
        steps.append((child, struct, is_map_key))
        node, name = _definition(child)
        struct = name or struct
    return steps


def field_path(path: list[str | int]) -> str:
    """A JSON path as ``field.Path`` prints it: ``spec.template.spec.containers[0].resources.limits[cpu]``."""
    text = ""
    for part, (_, _, is_map_key) in zip(path, _walk(path), strict=True):
        if isinstance(part, int) or is_map_key:
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text


def _go_type(node: dict[str, Any]) -> str:
    """The Go type a schema node decodes into, as ``encoding/json`` names it in errors."""
    node, name = _definition(node)
    types = [t for t in node.get("type", []) if t != "null"] if isinstance(node.get("type"), list) else \
        [node.get("type")]
    kind = types[0] if types else None
    if name and kind == "object" and "properties" in node:
        return f"v1.{name}"
    if kind == "integer":
        return node.get("format", "int64")
    if kind == "number":
        return "float64"
    if kind == "boolean":
        return "bool"
    if kind == "array":
        return "[]" + _go_type(node.get("items", {}))
    if kind == "object":
        return "map[string]" + _go_type(node.get("additionalProperties") or {"type": "string"})
    return "string"


def _json_kind(value: Any) -> str:
    """How Go's JSON decoder names the kind of a JSON value it could not decode."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _cannot_handle(detail: str) -> ApiError:
    return bad_request(f'Job in version "v1" cannot be handled as a Job: {detail}')


FIELD_VALIDATION = ("Ignore", "Warn", "Strict")


def check_field_validation(value: str | None, kind: str = "CreateOptions") -> str:
    """The ``fieldValidation`` directive of a write (default ``Warn``), or the 422 for a value it cannot take."""
    if value in (None, ""):
        return "Warn"
    if value not in FIELD_VALIDATION:
        errors = FieldErrors()
        errors.add(not_supported("fieldValidation", value, ["", *sorted(FIELD_VALIDATION)]))
        raise invalid_object(kind, "meta.k8s.io", "", errors)
    return value


def decode_job(body: dict[str, Any], field_validation: str = "Strict") -> list[str]:
    """Decoding errors, in the order the decoder meets them: unknown fields (400 in ``Strict``, else dropped and,
    in ``Warn``, returned as warnings), wrong types (400), required (422)."""
    errors = sorted(_validator().iter_errors(body), key=lambda e: list(map(str, e.absolute_path)))
    unknown = [e for e in errors if e.validator == "additionalProperties"]
    found = [f"unknown field {json.dumps(f)}" for e in unknown for f in _unknown_fields(e)]
    if found and field_validation == "Strict":
        raise _cannot_handle(f"strict decoding error: {', '.join(found)}")
    for error in unknown:
        allowed = set(error.schema.get("properties", {}))
        for name in [n for n in error.instance if n not in allowed]:
            del error.instance[name]
    errors = [e for e in errors if e.validator != "additionalProperties"]
    _check_quantities(body)
    for error in errors:
        if error.validator in ("type", "oneOf"):
            path = list(error.absolute_path)
            node, struct, _ = _walk(path)[-1] if path else ({}, "Job", False)
            dotted = ".".join(str(p) for p in path if not isinstance(p, int))
            raise _cannot_handle(f"json: cannot unmarshal {_json_kind(error.instance)} into Go struct field "
                                 f"{struct}.{dotted} of type {_go_type(node)}")
    missing = FieldErrors()
    for error in errors:
        if error.validator == "required":
            for name in error.validator_value:
                if name not in error.instance:
                    missing.add(required(field_path([*error.absolute_path, name])))
        elif error.validator == "enum":
            missing.add(not_supported(field_path(list(error.absolute_path)), error.instance,
                                      [str(v) for v in error.validator_value]))
    if missing.items:
        raise invalid_object("Job", "batch", body.get("metadata", {}).get("name", ""), missing)
    return found if field_validation == "Warn" else []


def _unknown_fields(error: Any) -> list[str]:
    """The dotted paths of the properties an ``additionalProperties: false`` error is about."""
    allowed = set(error.schema.get("properties", {}))
    base = field_path(list(error.absolute_path))
    return [f"{base}.{name}" if base else name for name in error.instance if name not in allowed]


def _check_quantities(job: dict[str, Any]) -> None:
    """The quantity decoder runs while decoding, so a malformed ``"2Gb"`` is a 400, not a 422."""
    for container in _containers(job.get("spec", {}).get("template", {}).get("spec", {})):
        for section in ("limits", "requests"):
            for raw in ((container.get("resources") or {}).get(section) or {}).values():
                try:
                    parse_quantity(raw)
                except QuantityError as exc:
                    raise _cannot_handle(str(exc)) from None


def _containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in (pod_spec.get("initContainers") or []) + (pod_spec.get("containers") or [])
            if isinstance(c, dict)]


# ---------------------------------------------------------------------------------------------------- defaulting

def default_image_pull_policy(image: str) -> str:
    """``SetDefaults_Container``: ``Always`` for ``:latest`` or no tag, else ``IfNotPresent``."""
    last = image.rsplit("/", 1)[-1]
    if "@" in last:
        return "IfNotPresent"
    tag = last.split(":", 1)[1] if ":" in last else ""
    return "Always" if tag in ("", "latest") else "IfNotPresent"


def default_pod_spec(spec: dict[str, Any]) -> None:
    """``SetDefaults_PodSpec`` and ``SetDefaults_Container``, the fields ``kubectl get -o yaml`` shows."""
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    for container in _containers(spec):
        container.setdefault("terminationMessagePath", "/dev/termination-log")
        container.setdefault("terminationMessagePolicy", "File")
        container.setdefault("imagePullPolicy", default_image_pull_policy(str(container.get("image", ""))))
        container.setdefault("resources", {})
        for env in container.get("env") or []:
            field_ref = (env.get("valueFrom") or {}).get("fieldRef")
            if field_ref is not None:
                field_ref.setdefault("apiVersion", "v1")


def default_job(job: dict[str, Any]) -> dict[str, Any]:
    """``SetDefaults_Job``: a copy of the Job with the API server's defaults filled in."""
    job = copy.deepcopy(job)
    spec = job.setdefault("spec", {})
    if spec.get("completions") is None and spec.get("parallelism") is None:
        spec["completions"] = 1
        spec["parallelism"] = 1
    spec.setdefault("parallelism", 1)
    if spec.get("backoffLimit") is None:
        spec["backoffLimit"] = MAX_INT32 if spec.get("backoffLimitPerIndex") is not None else 6
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    spec.setdefault("manualSelector", False)
    policy = spec.get("podFailurePolicy")
    if policy:
        for rule in policy.get("rules") or []:
            for pattern in rule.get("onPodConditions") or []:
                pattern.setdefault("status", "True")
    if spec.get("podReplacementPolicy") is None:
        spec["podReplacementPolicy"] = "Failed" if policy else "TerminatingOrFailed"
    template = spec.setdefault("template", {})
    template.setdefault("metadata", {})
    default_pod_spec(template.setdefault("spec", {}))
    return job


# ---------------------------------------------------------------------------------------------------- validation

_PFP_ACTIONS = ["Count", "FailIndex", "FailJob", "Ignore"]
_FIELD_REFS = ["metadata.annotations", "metadata.labels", "metadata.name", "metadata.namespace", "metadata.uid",
               "spec.nodeName", "spec.serviceAccountName", "status.hostIP", "status.hostIPs", "status.podIP",
               "status.podIPs"]
_STANDARD_RESOURCES = {"cpu", "memory", "ephemeral-storage"}


def validate_job(job: dict[str, Any]) -> None:
    """``ValidateJob`` on a defaulted Job; raises one 422 with every field error."""
    errors = FieldErrors()
    meta = job.get("metadata", {})
    name = meta.get("name") or ""
    _validate_object_meta(meta, errors)
    spec = job["spec"]
    _validate_job_spec(spec, errors)
    if spec.get("completionMode") == "Indexed" and (spec.get("completions") or 0) > 0 and name:
        hostname = f"{name}-{spec['completions'] - 1}"
        if dns1123_label_errors(hostname):
            errors.add(invalid("metadata.name", name,
                               f"will not able to create pod with invalid DNS label: {hostname}"))
    if errors.items:
        raise invalid_object("Job", "batch", name, errors)


def _validate_object_meta(meta: dict[str, Any], errors: FieldErrors) -> None:
    """``ValidateObjectMeta`` with ``NameIsDNSSubdomain``."""
    name, generate = meta.get("name"), meta.get("generateName")
    if not name and not generate:
        errors.add(required("metadata.name", "name or generateName is required"))
    elif name:
        errors.add(*(invalid("metadata.name", name, m) for m in dns1123_subdomain_errors(name)))
    validate_labels(meta.get("labels"), "metadata.labels", errors)
    for key in meta.get("annotations") or {}:
        errors.add(*(invalid("metadata.annotations", key, m) for m in label_key_errors(key.lower())))


def _nonnegative(spec: dict[str, Any], key: str, errors: FieldErrors, path: str = "spec") -> None:
    value = spec.get(key)
    if value is not None and value < 0:
        errors.add(invalid(f"{path}.{key}", value, "must be greater than or equal to 0"))


def _validate_job_spec(spec: dict[str, Any], errors: FieldErrors) -> None:
    """``validateJobSpec``: counts, the indexed-mode rules, the failure policy and the pod template."""
    for key in ("parallelism", "completions", "activeDeadlineSeconds", "backoffLimit", "ttlSecondsAfterFinished",
                "backoffLimitPerIndex", "maxFailedIndexes"):
        _nonnegative(spec, key, errors)
    if spec.get("maxFailedIndexes") is not None and spec.get("backoffLimitPerIndex") is None:
        errors.add(required("spec.backoffLimitPerIndex", "when maxFailedIndexes is specified"))
    mode = spec.get("completionMode")
    if mode not in ("NonIndexed", "Indexed"):
        errors.add(not_supported("spec.completionMode", mode, ["NonIndexed", "Indexed"]))
    if mode == "Indexed":
        _validate_indexed(spec, errors)
    else:
        for key in ("backoffLimitPerIndex", "maxFailedIndexes"):
            if spec.get(key) is not None:
                errors.add(invalid(f"spec.{key}", spec[key], "requires indexed completion mode"))
    if spec.get("podFailurePolicy") is not None:
        _validate_pod_failure_policy(spec, errors)
    replacement = spec.get("podReplacementPolicy")
    allowed = ["Failed"] if spec.get("podFailurePolicy") is not None else ["Failed", "TerminatingOrFailed"]
    if replacement not in allowed:
        errors.add(not_supported("spec.podReplacementPolicy", replacement, allowed))
    _validate_generated_selector(spec, errors)
    template = spec.get("template") or {}
    validate_labels((template.get("metadata") or {}).get("labels"), "spec.template.metadata.labels", errors)
    pod_spec = template.get("spec") or {}
    validate_pod_spec(pod_spec, "spec.template.spec", errors)
    restart = pod_spec.get("restartPolicy")
    if restart in ("Always", "", None):
        errors.add(required("spec.template.spec.restartPolicy", 'valid values: "OnFailure", "Never"'))
    elif restart not in ("OnFailure", "Never"):
        errors.add(not_supported("spec.template.spec.restartPolicy", restart, ["OnFailure", "Never"]))
    elif spec.get("podFailurePolicy") is not None and restart != "Never":
        errors.add(invalid("spec.template.spec.restartPolicy", restart,
                           'only "Never" is supported when podFailurePolicy is specified'))


def _validate_generated_selector(spec: dict[str, Any], errors: FieldErrors) -> None:
    """``validateGeneratedSelector``: unless ``manualSelector``, the selector must pick the generated labels."""
    selector = spec.get("selector")
    if spec.get("manualSelector") or selector is None:
        if selector is None:
            errors.add(required("spec.selector"))
        return
    labels = (spec.get("template", {}).get("metadata") or {}).get("labels") or {}
    wanted = selector.get("matchLabels") or {}
    if selector.get("matchExpressions") or any(labels.get(k) != v for k, v in wanted.items()):
        errors.add(invalid("spec.selector", selector, "`selector` not auto-generated"))


def _validate_indexed(spec: dict[str, Any], errors: FieldErrors) -> None:
    """The ``completionMode: Indexed`` rules."""
    completions, parallelism, max_failed = spec.get("completions"), spec.get("parallelism"), \
        spec.get("maxFailedIndexes")
    if completions is None:
        errors.add(required("spec.completions", "when completion mode is Indexed"))
    if parallelism is not None and parallelism > 100000:
        errors.add(invalid("spec.parallelism", parallelism,
                           "must be less than or equal to 100000 when completion mode is Indexed"))
    if completions is not None and max_failed is not None and max_failed > completions:
        errors.add(invalid("spec.maxFailedIndexes", max_failed, "must be less than or equal to completions"))
    if max_failed is not None and max_failed > 100000:
        errors.add(invalid("spec.maxFailedIndexes", max_failed, "must be less than or equal to 100000"))


def _validate_pod_failure_policy(spec: dict[str, Any], errors: FieldErrors) -> None:
    """``validatePodFailurePolicy`` and its rule checks."""
    rules = spec["podFailurePolicy"].get("rules") or []
    if len(rules) > 20:
        errors.add(too_many("spec.podFailurePolicy.rules", len(rules), 20))
    names = {c.get("name") for c in _containers(spec.get("template", {}).get("spec", {}))}
    for i, rule in enumerate(rules):
        path = f"spec.podFailurePolicy.rules[{i}]"
        action = rule.get("action") or ""
        if not action:
            errors.add(required(f"{path}.action", "valid values: [" + " ".join(map(go_quote, _PFP_ACTIONS)) + "]"))
        elif action == "FailIndex" and spec.get("backoffLimitPerIndex") is None:
            errors.add(invalid(f"{path}.action", action, "requires the backoffLimitPerIndex to be set"))
        elif action not in _PFP_ACTIONS:
            errors.add(not_supported(f"{path}.action", action, _PFP_ACTIONS))
        on_codes, on_conditions = rule.get("onExitCodes"), rule.get("onPodConditions") or []
        if on_codes is not None:
            _validate_on_exit_codes(on_codes, f"{path}.onExitCodes", names, errors)
        for j, pattern in enumerate(on_conditions):
            status = pattern.get("status")
            if status not in ("False", "True", "Unknown"):
                errors.add(not_supported(f"{path}.onPodConditions[{j}].status", status,
                                         ["False", "True", "Unknown"]))
            errors.add(*(invalid(f"{path}.onPodConditions[{j}].type", pattern.get("type", ""), m)
                         for m in label_key_errors(pattern.get("type", ""))))
        if on_codes is not None and on_conditions:
            errors.add(FieldError("FieldValueInvalid", path, OMIT,
                                  "specifying both OnExitCodes and OnPodConditions is not supported"))
        if on_codes is None and not on_conditions:
            errors.add(FieldError("FieldValueInvalid", path, OMIT,
                                  "specifying one of OnExitCodes and OnPodConditions is required"))


def _validate_on_exit_codes(req: dict[str, Any], path: str, names: set[Any], errors: FieldErrors) -> None:
    """``validatePodFailurePolicyRuleOnExitCodes``."""
    operator = req.get("operator")
    if operator not in ("In", "NotIn"):
        errors.add(not_supported(f"{path}.operator", operator, ["In", "NotIn"]))
    if req.get("containerName") is not None and req["containerName"] not in names:
        errors.add(invalid(f"{path}.containerName", req["containerName"],
                           "must be one of the container or initContainer names in the pod template"))
    values = req.get("values") or []
    if not values:
        errors.add(invalid(f"{path}.values", values, "at least one value is required"))
    elif len(values) > 255:
        errors.add(too_many(f"{path}.values", len(values), 255))
    seen: set[int] = set()
    for j, value in enumerate(values):
        if operator == "In" and value == 0:
            errors.add(invalid(f"{path}.values[{j}]", value, "must not be 0 for the In operator"))
        if value in seen:
            errors.add(duplicate(f"{path}.values[{j}]", value))
        seen.add(value)
    if values != sorted(values):
        errors.add(invalid(f"{path}.values", values, "must be ordered"))


def validate_pod_spec(spec: dict[str, Any], path: str, errors: FieldErrors) -> None:
    """The parts of ``ValidatePodSpec`` a batch workload touches: containers, env, resources, scheduling."""
    containers = spec.get("containers") or []
    if not containers:
        errors.add(required(f"{path}.containers"))
    seen: set[str] = set()
    for kind in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(kind) or []):
            _validate_container(container, f"{path}.{kind}[{i}]", seen, errors)
    account = spec.get("serviceAccountName")
    if account:
        errors.add(*(invalid(f"{path}.serviceAccountName", account, m) for m in dns1123_subdomain_errors(account)))
    validate_labels(spec.get("nodeSelector"), f"{path}.nodeSelector", errors)
    for i, toleration in enumerate(spec.get("tolerations") or []):
        _validate_toleration(toleration, f"{path}.tolerations[{i}]", errors)
    grace = spec.get("terminationGracePeriodSeconds")
    if grace is not None and grace < 0:
        errors.add(invalid(f"{path}.terminationGracePeriodSeconds", grace, "must be greater than or equal to 0"))


def _validate_container(container: dict[str, Any], path: str, seen: set[str], errors: FieldErrors) -> None:
    """Name, image, pull policy, env and resources of one container."""
    name = container.get("name") or ""
    if not name:
        errors.add(required(f"{path}.name"))
    else:
        errors.add(*(invalid(f"{path}.name", name, m) for m in dns1123_label_errors(name)))
        if name in seen:
            errors.add(duplicate(f"{path}.name", name))
        seen.add(name)
    image = container.get("image") or ""
    if not image:
        errors.add(required(f"{path}.image"))
    elif image != image.strip():
        errors.add(invalid(f"{path}.image", image, "must not have leading or trailing whitespace"))
    policy = container.get("imagePullPolicy")
    if policy not in ("Always", "IfNotPresent", "Never"):
        errors.add(not_supported(f"{path}.imagePullPolicy", policy, ["Always", "IfNotPresent", "Never"]))
    for i, env in enumerate(container.get("env") or []):
        _validate_env(env, f"{path}.env[{i}]", errors)
    _validate_resources(container.get("resources") or {}, f"{path}.resources", errors)


def _validate_env(env: dict[str, Any], path: str, errors: FieldErrors) -> None:
    """Env names (the relaxed rule, beta and on in 1.33) and the downward-API field references."""
    name = env.get("name") or ""
    if not name:
        errors.add(required(f"{path}.name"))
    elif "=" in name or not all(" " <= ch <= "~" for ch in name):
        errors.add(invalid(f"{path}.name", name,
                           "a valid environment variable name must consist only of printable ASCII characters "
                           "other than '='"))
    source = env.get("valueFrom")
    if source is None:
        return
    if env.get("value"):
        errors.add(invalid(f"{path}.valueFrom", "",
                           "may not be specified when `value` is not empty"))
    kinds = [k for k in ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef") if source.get(k)]
    if len(kinds) != 1:
        errors.add(invalid(f"{path}.valueFrom", "",
                           "may not have more than one field specified at a time" if kinds else
                           "must specify one of: `fieldRef`, `resourceFieldRef`, `configMapKeyRef` or "
                           "`secretKeyRef`"))
        return
    field_ref = source.get("fieldRef")
    if field_ref:
        _validate_field_ref(field_ref, f"{path}.valueFrom.fieldRef", errors)


def _validate_field_ref(ref: dict[str, Any], path: str, errors: FieldErrors) -> None:
    """``validateObjectFieldSelector``: a supported path, subscripts only on labels and annotations."""
    selector = ref.get("fieldPath") or ""
    match = re.fullmatch(r"(metadata\.(?:labels|annotations))\['([^']*)'\]", selector)
    if match:
        errors.add(*(invalid(f"{path}.fieldPath", match.group(2), m) for m in label_key_errors(match.group(2))))
    elif selector not in _FIELD_REFS or selector in ("metadata.labels", "metadata.annotations"):
        supported = [s for s in _FIELD_REFS]
        errors.add(not_supported(f"{path}.fieldPath", selector, supported))


def _validate_resources(resources: dict[str, Any], path: str, errors: FieldErrors) -> None:
    """``ValidateResourceRequirements``: names, non-negative, integers for extended resources, requests vs limits."""
    limits = {k: parse_quantity(v) for k, v in (resources.get("limits") or {}).items()}
    requests = {k: parse_quantity(v) for k, v in (resources.get("requests") or {}).items()}
    for section, values in (("limits", limits), ("requests", requests)):
        for name, (value, fmt) in values.items():
            key_path = f"{path}.{section}[{name}]"
            _validate_resource_name(name, key_path, errors)
            if value < 0:
                errors.add(invalid(key_path, canonical_quantity(value, fmt), "must be greater than or equal to 0"))
            if _is_integer_resource(name) and value != value.to_integral_value():
                errors.add(invalid(key_path, canonical_quantity(value, fmt), "must be an integer"))
    for name, (value, fmt) in requests.items():
        text = canonical_quantity(value, fmt)
        if name in limits:
            limit = canonical_quantity(*limits[name])
            if value != limits[name][0] and not _overcommit_allowed(name):
                errors.add(invalid(f"{path}.requests", text, f"must be equal to {name} limit of {limit}"))
            elif value > limits[name][0]:
                errors.add(invalid(f"{path}.requests", text, f"must be less than or equal to {name} limit of {limit}"))
        elif not _overcommit_allowed(name):
            errors.add(required(f"{path}.limits", "Limit must be set for non overcommitable resources"))


def _validate_resource_name(name: str, path: str, errors: FieldErrors) -> None:
    if "/" not in name:
        if name not in _STANDARD_RESOURCES and not name.startswith("hugepages-"):
            errors.add(invalid(path, name, "must be a standard resource for containers"))
    elif label_key_errors(name):
        errors.add(*(invalid(path, name, m) for m in label_key_errors(name)))


def _is_integer_resource(name: str) -> bool:
    """Extended resources (``nvidia.com/gpu``) are whole devices."""
    return "/" in name and not name.startswith("kubernetes.io/") and not name.startswith("requests.")


def _overcommit_allowed(name: str) -> bool:
    """Only native resources may request less than their limit; ``nvidia.com/gpu`` must ask for exactly it."""
    return not _is_integer_resource(name) and not name.startswith("hugepages-")


def _validate_toleration(toleration: dict[str, Any], path: str, errors: FieldErrors) -> None:
    """``ValidateTolerations``."""
    key, operator = toleration.get("key") or "", toleration.get("operator") or "Equal"
    if key:
        errors.add(*(invalid(f"{path}.key", key, m) for m in label_key_errors(key)))
    elif operator != "Exists":
        errors.add(invalid(f"{path}.operator", operator, "operator must be Exists when `key` is empty, which means "
                                                          "\"match all values and all keys\""))
    if operator == "Exists" and toleration.get("value"):
        errors.add(invalid(f"{path}.operator", toleration["value"],
                           "value must be empty when `operator` is 'Exists'"))
    elif operator not in ("Equal", "Exists"):
        errors.add(not_supported(f"{path}.operator", operator, ["Equal", "Exists"]))
    effect = toleration.get("effect") or ""
    if effect and effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
        errors.add(not_supported(f"{path}.effect", effect, ["NoSchedule", "PreferNoSchedule", "NoExecute"]))
    if toleration.get("tolerationSeconds") is not None and effect != "NoExecute":
        errors.add(invalid(f"{path}.effect", effect, "effect must be 'NoExecute' when `tolerationSeconds` is set"))


def admit_job(body: Any, prepare: Callable[[dict[str, Any]], None],
              field_validation: str = "Strict") -> tuple[dict[str, Any], list[str]]:
    """Decode, default, ``prepare`` (the strategy's uid, selector and labels) and validate, as the create handler;
    the stored Job and the decoder's warnings."""
    if not isinstance(body, dict):
        raise bad_request("the body of the request was in an unknown format - accepted media types include: "
                          "application/json, application/yaml, application/vnd.kubernetes.protobuf")
    if body.get("kind") not in (None, "Job") or body.get("apiVersion") not in (None, "batch/v1"):
        raise bad_request(f"the API version in the data ({body.get('apiVersion')}) does not match the expected API "
                          "version (batch/v1)" if body.get("apiVersion") not in (None, "batch/v1") else
                          f"the kind in the data ({body.get('kind')}) does not match the expected kind (Job)")
    warnings = decode_job(body, field_validation)
    job = default_job(body)
    prepare(job)
    validate_job(job)
    return job, warnings


__all__ = ["ApiError", "FIELD_VALIDATION", "admit_job", "canonical_quantity", "check_field_validation", "default_pod_spec", "dns1123_label_errors",
           "dns1123_subdomain_errors", "parse_quantity", "validate_labels"]
