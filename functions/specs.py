"""Job specs: what every kind's spec shares, and parsing a spec of any kind.

A spec is a pydantic model that round-trips through JSON, so the CLI, the SDK, ``shardfold watch`` and the
bucket trigger accept the same documents. It names its ``kind``; every other field belongs to that kind's
model (``functions/<kind>/spec.py``, registered by the kind's descriptor, :mod:`functions.kinds`).
Validation errors become :class:`SpecError` listing every problem with the field at fault.

**URI fields are declared, not listed.** A field that holds an object URI is typed :data:`InputUri` (the
job reads it) or :data:`OutputUri` (the job writes it). From that metadata alone

* a ``./x`` or ``../x`` value in a spec *file* resolves against the file's own location, so a spec can
  travel with its data (``events/getbatch.json`` + ``events/data/``): :func:`parse_spec` with ``base_uri``
  (the SDK gives a dict's the working directory); an absolute path ``/x`` is the local file ``file:///x``;
  a bare ``x`` is the key ``x`` under the store root;
* every value is kept in normal form (:func:`functions.store.uri.normalise`): a key under the store root
  without ``./``, ``//`` or ``a/..`` (``./c``, ``.//c`` and ``a/../c`` are all ``c``), a ``file://`` path
  without ``//`` or ``/./``, so one object has one name and :func:`repeated_uris` finds a repeat by string;
* :func:`uri_fields` lists a spec's URIs with their field path and role (what the job reads and writes).
"""

from __future__ import annotations

import difflib
import functools
import json
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shardfold.functions import jsontext
from shardfold.functions.errors import SpecError


class StrictModel(BaseModel):
    """Unknown fields are errors: a typo in a spec must not be silently ignored. Values are not coerced
    (pydantic's strict mode): ``"2"`` is not a number and ``1`` is not ``true``; an integer is still a
    valid float, and NaN and infinities are not numbers here. A spec comes from JSON, so a tuple field must
    accept a JSON list: give it
    ``Field(strict=False)`` with strict element types (``tuple[StrictInt, StrictInt]``)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class JobOptions(StrictModel):
    """What every kind's spec may say besides its own fields (a kind's spec model derives from this)."""

    deadline_s: float | None = Field(
        default=None,
        gt=0,
        description="seconds from submit by which the job should end; `shardfold report` says whether it did",
    )
    local_files: bool = Field(
        default=True,
        description="the job may name files of this machine outside the store (file:// paths, local store "
        "only); a spec dropped into a watched folder or the bucket may not, whatever it says",
    )
    overwrite: bool = Field(
        default=False,
        description="replace what is already at the output (another job's finished output, or an object no "
        "job wrote); an output whose job has not ended is never taken",
    )


# --- URI fields --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UriRole:
    """Marks a spec field as an object URI that the job reads (``"input"``) or writes (``"output"``); an
    output ``prefix`` is a folder the job writes several objects under."""

    role: Literal["input", "output"]
    prefix: bool = False


def _parent(uri: str) -> str:
    return uri.rsplit("/", 1)[0] if "/" in uri else ""


def resolve_relative(value: str, base_uri: str) -> str:
    """``value`` (``./x`` or ``../x``) against the directory of ``base_uri``; other values unchanged.

    ``..`` never climbs above the bucket (s3) or the filesystem root (file)."""
    if not value.startswith(("./", "../")):
        return value
    base_dir = _parent(base_uri)
    scheme, sep, path = base_dir.partition("://")
    parts = path.split("/") if sep else base_dir.split("/")
    for seg in value.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if len(parts) > (1 if sep else 0):
                parts.pop()
            continue
        parts.append(seg)
    joined = "/".join(parts)
    return f"{scheme}://{joined}" if sep else joined


def _resolve_against_spec_file(value: str, info: ValidationInfo) -> str:
    """``value`` resolved against the spec file (if any), in normal form."""
    base = (info.context or {}).get("base_uri")
    if value.startswith("/") and not value.startswith("//"):
        value = "file://" + value  # an absolute path is a local file, as it is to every other program
    return _normalise()(resolve_relative(value, base) if base else value)


@functools.cache
def _normalise() -> Callable[[str], str]:
    # Imported on first use: functions.store's package imports boto3, which parsing a spec does not otherwise
    # need. Cached: a request of 50,000 items calls this once per item.
    from shardfold.functions.store.uri import normalise

    return normalise


def _names_an_object(value: str) -> str:
    """An output that is one object must end with its name: ``results/`` or ``results/.`` names a folder
    (locally it fails once written; on S3 it writes the key ``results/``)."""
    if value.endswith("/") or value.rsplit("/", 1)[-1] in (".", ".."):
        raise ValueError(f"{value!r} names a folder, not an object; end it with the object's name")
    return value


InputUri = Annotated[str, Field(min_length=1), UriRole("input"), AfterValidator(_resolve_against_spec_file)]
OutputUri = Annotated[
    str,
    Field(min_length=1),
    UriRole("output"),
    AfterValidator(_names_an_object),
    AfterValidator(_resolve_against_spec_file),
]
OutputPrefix = Annotated[
    str, Field(min_length=1), UriRole("output", prefix=True), AfterValidator(_resolve_against_spec_file)
]


def repeated_uris(uris: Sequence[str]) -> list[tuple[int, int]]:
    """``(i, j)`` for every ``uris[i]`` that names the same object as an earlier ``uris[j]`` (the first),
    compared in normal form (:func:`functions.store.uri.normalise`): ``./c``, ``c`` and ``a/../c`` are one.
    Kinds whose inputs must be distinct (fedavg's clients, inference's inputs) refuse these by field."""
    from shardfold.functions.store.uri import normalise

    first: dict[str, int] = {}
    repeats = []
    for i, uri in enumerate(uris):
        j = first.setdefault(normalise(uri), i)
        if j != i:
            repeats.append((i, j))
    return repeats


@dataclass(frozen=True)
class UriField:
    """One URI of a spec: where it is (``("clients", 2, "uri")``), its value and whether the job reads it."""

    loc: tuple[str | int, ...]
    uri: str
    role: Literal["input", "output"]
    prefix: bool = False

    @property
    def field(self) -> str:
        return ".".join(map(str, self.loc))


_last_fields: tuple[Any, tuple[str | int, ...], list[UriField]] | None = None


def uri_fields(model: BaseModel, loc: tuple[str | int, ...] = ()) -> Iterator[UriField]:
    """Every URI a spec names, from the fields typed :data:`InputUri` / :data:`OutputUri`, in field order.
    The last spec's list is kept: submit's checks each walk it, and a request of 50,000 items took 0.35 s
    a walk. (A spec is not changed once parsed; a changed copy is another object.)"""
    global _last_fields
    last = _last_fields
    if last is not None and last[0] is model and last[1] == loc:
        return iter(last[2])
    found: list[UriField] = []
    _model_uris(model, loc, found)
    _last_fields = (model, loc, found)
    return iter(found)


def _model_uris(model: BaseModel, loc: tuple[str | int, ...], out: list[UriField]) -> None:
    for name, key, role, annotation in _fields(type(model)):
        value = getattr(model, name)
        if role is not None:
            if isinstance(value, str):
                out.append(UriField((*loc, key), value, role.role, role.prefix))
            continue
        if value is not None:
            _walk(value, annotation, (*loc, key), out)


def _walk(value: Any, annotation: Any, loc: tuple[str | int, ...], out: list[UriField]) -> None:
    if value is None:
        return
    if isinstance(value, BaseModel):
        _model_uris(value, loc, out)
        return
    shape = _shape(annotation)
    kind = shape[0]
    if kind == "annotated":
        _, role, base = shape
        if role is not None:
            if isinstance(value, str):
                out.append(UriField(loc, value, role.role, role.prefix))
            return
        _walk(value, base, loc, out)
    elif kind == "union":
        for option in shape[1]:  # the first option whose shape fits the value
            found: list[UriField] = []
            _walk(value, option, loc, found)
            if found:
                out.extend(found)
                return
    elif kind == "list" and isinstance(value, list):
        element = shape[1]
        for i, v in enumerate(value):
            if isinstance(v, BaseModel):  # the common case (a request's items): no shape to work out
                _model_uris(v, (*loc, i), out)
            else:
                _walk(v, element, (*loc, i), out)


# What the walk needs of a model class and of an annotation, worked out once (a spec may list thousands of
# items of one class): typing's introspection per item cost more than the rest of the walk.
_FIELD_PLANS: dict[type, tuple[tuple[str, str, UriRole | None, Any], ...]] = {}
_SHAPES: dict[int, tuple[Any, tuple[Any, ...]]] = {}


def _fields(cls: type[BaseModel]) -> tuple[tuple[str, str, UriRole | None, Any], ...]:
    """(attribute, key in the document, its URI role or None, annotation) of each field that may hold a URI,
    in order: a field whose type can hold none (an item's ``start``, ``name``) is left out, so the walk
    never looks at it (it was most of a 50,000-item request's walk)."""
    plan = _FIELD_PLANS.get(cls)
    if plan is None:
        plan = tuple(
            (name, info.alias or name, role, info.annotation)
            for name, info in cls.model_fields.items()
            if (role := next((m for m in info.metadata if isinstance(m, UriRole)), None)) is not None
            or _may_hold_uris(info.annotation)
        )
        _FIELD_PLANS[cls] = plan
    return plan


def _may_hold_uris(annotation: Any, seen: frozenset[type] = frozenset()) -> bool:
    """Whether a value of this type may hold a URI field: a URI type, a model with one, or a union, list or
    annotation of such; any type the walk does not know (``Any``, a class it cannot see into) counts."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if annotation in seen:
            return False  # a model within itself: its fields are being looked at already
        inner = seen | {annotation}
        return any(
            any(isinstance(m, UriRole) for m in info.metadata) or _may_hold_uris(info.annotation, inner)
            for info in annotation.model_fields.values()
        )
    if annotation in _PLAIN_TYPES:
        return False
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *meta = get_args(annotation)
        return any(isinstance(m, UriRole) for m in meta) or _may_hold_uris(base, seen)
    if origin in (Union, types.UnionType, list, Literal):
        return origin is not Literal and any(_may_hold_uris(a, seen) for a in get_args(annotation))
    return True


_PLAIN_TYPES = (int, float, str, bool, bytes, type(None))


def _shape(annotation: Any) -> tuple[Any, ...]:
    """``("annotated", role, base)``, ``("union", options)``, ``("list", element)`` or ``("other",)``."""
    hit = _SHAPES.get(id(annotation))
    if hit is not None and hit[0] is annotation:
        return hit[1]
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *meta = get_args(annotation)
        shape: tuple[Any, ...] = ("annotated", next((m for m in meta if isinstance(m, UriRole)), None), base)
    elif origin in (Union, types.UnionType):
        shape = ("union", get_args(annotation))
    elif origin is list:
        shape = ("list", get_args(annotation)[0])
    else:
        shape = ("other",)
    _SHAPES[id(annotation)] = (annotation, shape)  # the annotation is kept alive, so its id stays its own
    return shape


# --- pieces several kinds share -----------------------------------------------------------------------------


class BatchItem(StrictModel):
    """One entry of a GetBatch request (a getbatch job's item; also how every kind reads its inputs).

    ``uri`` is an object URI (``s3://bucket/key``, ``file:///abs/path``, or a key relative to the store
    root). A byte range is ``start`` plus ``length`` (``None``: to the end of the object). ``archpath``
    names a member of a TAR object; a range then applies to the member. ``name`` overrides the entry's
    name in the output archive (default: the object key, plus ``/archpath``; a local file given relative to
    a local spec file, ``./data/x``, is named by that path, ``data/x``, so the archive does not depend on
    (nor show) the folder the spec sits in).
    """

    uri: InputUri
    start: int = Field(default=0, ge=0)
    length: int | None = Field(default=None, ge=0)
    archpath: str | None = Field(default=None, min_length=1)
    name: str | None = Field(default=None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _name_files_by_their_path_from_the_spec(cls, data: Any, info: ValidationInfo) -> Any:
        base = (info.context or {}).get("base_uri") or ""
        uri = data.get("uri") if isinstance(data, dict) else None
        if (
            isinstance(uri, str)
            and uri.startswith(("./", "../"))
            and base.startswith("file://")
            and data.get("name") is None
        ):
            name = "/".join(seg for seg in uri.split("/") if seg not in ("", ".", ".."))
            if name:
                path = f"{name}/{data['archpath'].lstrip('/')}" if data.get("archpath") else name
                data = {**data, "name": path}
        return data

    @field_validator("length")
    @classmethod
    def _range_is_meaningful(cls, value: int | None, info: ValidationInfo) -> int | None:
        # on the field (checked only where a length is given), not the model: a request has thousands of items
        if value == 0 and info.data.get("start", 0) != 0:
            raise ValueError("length 0 with a non-zero start selects nothing; omit length to read to the end")
        return value

    @field_validator("name")
    @classmethod
    def _safe_entry_name(cls, value: str | None) -> str | None:
        # an archive entry name is where an extracting tool writes the file: it must stay inside the folder
        # and read as what it is (a default name, an object key plus archpath, is made safe when written)
        from shardfold.functions.store.tar import unsafe_name

        why = None if value is None else unsafe_name(value)
        if why:
            raise ValueError(f"name {value[:100]!r} {why}")
        return value

    @field_validator("archpath")
    @classmethod
    def _relative_member(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if "\x00" in value:
            raise ValueError(f"archpath {value!r} contains a NUL character")
        if value.startswith("/") or ".." in value.split("/"):
            raise ValueError(f"archpath {value!r} leaves the archive; give a member's relative path")
        return value


def fail(title: str, problems: list[tuple[tuple, str]], value: Any) -> None:
    """Raise a ValidationError whose entries name the exact field of each problem (loc is absolute)."""
    from pydantic_core import InitErrorDetails, PydanticCustomError

    raise ValidationError.from_exception_data(
        title,
        [
            InitErrorDetails(type=PydanticCustomError("value_error", msg), loc=loc, input=value)
            for loc, msg in problems
        ],
    )


# --- parsing -----------------------------------------------------------------------------------------------

# Any kind's spec model (each is a StrictModel with a ``kind`` tag); the discriminated union of the registered
# kinds is :func:`functions.kinds.spec_union`.
JobSpec = StrictModel


_JSON_TYPES = {
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    list: "a list",
    dict: "an object",
    type(None): "null",
}


def json_type(value: Any) -> str:
    """What a decoded JSON value is, in a spec author's words: "a string", "an integer", "a list"..."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _message(e: Any) -> str:
    if e["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return "Input should be an object"
    return e["msg"]


def error_text(e: Any, msg: str | None = None) -> str:
    """One pydantic error entry as a sentence: its message, and for a wrong type what was given (a spec is
    JSON, so "a string" rather than "str"; never pydantic's documentation URL)."""
    msg = msg or _message(e)
    if e["type"].endswith("_type") or e["type"] == "literal_error":
        value = e.get("input")
        what = _JSON_TYPES.get(type(value))
        if what is not None:
            shown = json.dumps(value) if not isinstance(value, list | dict) else ""
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            msg += f" (got {what}{' ' + shown if shown and value is not None else ''})"
    return msg


def describe_errors(err: ValidationError, prefix: str = "", model: Any = None) -> list[dict]:
    """``[{"field", "error"}]``: each problem with the dotted path of its field (under ``prefix``).

    With the ``model`` that was validated, a field that may take one of several shapes (``workload``: a
    list or a generator) is named by its own path, without pydantic's label of each shape, and only the
    shape the value has is reported on: "workload.3.weight: ...", not also "workload: should be an
    object" from the shape it does not have."""
    found = _located(err, model)
    deeper = {u for _, u, mismatch, _ in found if u is not None and not mismatch}
    out: list[dict] = []
    shapes: dict[str, tuple[int, Any, list[str]]] = {}  # field -> (its entry, first error, shapes it has not)
    for loc, union_at, mismatch, e in found:
        if mismatch and union_at in deeper:  # the value has another shape, whose own errors are reported
            continue
        field = ".".join(str(p) for p in (*((prefix,) if prefix else ()), *loc)) or "<spec>"
        if mismatch:  # a value of none of the shapes: one entry listing them all
            if field in shapes:
                shapes[field][2].append(_message(e).removeprefix("Input should be "))
                continue
            shapes[field] = (len(out), e, [_message(e)])
        out.append({"field": field, "error": error_text(e) + _did_you_mean(e, loc, model)})
    for i, e, wanted in shapes.values():
        out[i]["error"] = error_text(e, " or ".join(wanted))
    return out


def _located(err: ValidationError, model: Any) -> list[tuple[tuple, tuple | None, bool, Any]]:
    """Each error with its union-free ``loc``, its union's path, and whether the value fits none of it."""
    found = []
    for e in err.errors():
        loc, union_at, whole = _without_union_labels(model, e["loc"]) if model else (e["loc"], None, False)
        found.append((loc, union_at, whole and _is_shape_error(e), e))
    return found


def _did_you_mean(e: Any, loc: tuple, model: Any) -> str:
    """For a key the model does not have, the nearest field name it does, as a hint ("" when none)."""
    if e["type"] != "extra_forbidden" or model is None or not loc:
        return ""
    cls = model if isinstance(model, type) else type(model)
    near = difflib.get_close_matches(str(loc[-1]), sorted(_field_names(cls)), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _field_names(cls: Any, seen: set | None = None) -> set[str]:
    """Every field name (and alias) of a spec model and the models it holds: what a misspelt key is
    matched against."""
    seen = set() if seen is None else seen
    if cls in seen or not (isinstance(cls, type) and issubclass(cls, BaseModel)):
        return set()
    seen.add(cls)
    names: set[str] = set()
    for name, info in cls.model_fields.items():
        names.add(info.alias or name)
        stack = [info.annotation]
        while stack:
            ann = stack.pop()
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                names |= _field_names(ann, seen)
            stack.extend(get_args(ann))
    return names


def _is_shape_error(e: Any) -> bool:
    return e["type"].endswith("_type") or e["type"] == "literal_error"


def _unwrap(ann: Any) -> Any:
    """``ann`` without ``Annotated`` and without ``| None``."""
    while True:
        origin = get_origin(ann)
        if origin is Annotated:
            ann = get_args(ann)[0]
        elif origin in (Union, types.UnionType):
            options = [a for a in get_args(ann) if a is not type(None)]
            if len(options) != 1:
                return ann
            ann = options[0]
        else:
            return ann


def _shapes(ann: Any) -> list | None:
    """The options of a union of two or more shapes (pydantic labels each in an error's loc), else None."""
    ann = _unwrap(ann)
    if get_origin(ann) in (Union, types.UnionType):
        return [a for a in get_args(ann) if a is not type(None)]
    return None


def _labelled(option: Any, label: str) -> bool:
    """Whether pydantic's ``label`` for a union option (``DPMarginalGenerator``, ``list[DPMarginal]``,
    ``literal['minilm']``, ``str``) names ``option``."""
    option = _unwrap(option)
    if isinstance(option, type) and get_origin(option) is None:
        return label == option.__name__
    origin = get_origin(option)
    name = getattr(origin, "__name__", None) or str(origin).rsplit(".", 1)[-1]
    return label.lower().startswith(name.lower() + "[")


def _child(ann: Any, seg: str | int) -> Any:
    ann = _unwrap(ann)
    if isinstance(ann, type) and issubclass(ann, BaseModel) and isinstance(seg, str):
        for name, info in ann.model_fields.items():
            if seg in (name, info.alias):
                return info.annotation
        return None
    origin = get_origin(ann)
    if origin is list and isinstance(seg, int):
        return get_args(ann)[0]
    if origin is tuple and isinstance(seg, int):
        args = get_args(ann)
        return args[seg] if seg < len(args) else None
    return None


def _without_union_labels(model: Any, loc: tuple) -> tuple[tuple, tuple | None, bool]:
    """(``loc`` without union labels, the path of the last union in it, whether the error is about the
    union's value as a whole)."""
    out: list = []
    ann, union_at, whole = model, None, False
    for i, seg in enumerate(loc):
        options = (_shapes(ann) if ann is not None else None) or []
        shape = next((o for o in options if isinstance(seg, str) and _labelled(o, seg)), None)
        if shape is not None:  # a label (a validator's own loc, e.g. from fail(), has none)
            ann, union_at, whole = shape, tuple(out), i == len(loc) - 1
            continue
        out.append(seg)
        ann = _child(ann, seg) if ann is not None else None
    return tuple(out), union_at, whole


def load_document(doc: dict | str | bytes) -> dict:
    """A spec document as a dict; :class:`SpecError` when it is not a JSON object, or not one this project
    accepts (:mod:`functions.jsontext`: too deep, a key twice, NaN or Infinity)."""
    try:
        doc = jsontext.loads(doc) if isinstance(doc, bytes | str) else jsontext.check_depth(doc)
    except jsontext.JSONTextError as exc:
        raise SpecError(f"spec is not valid JSON: {exc}", [{"field": "<spec>", "error": str(exc)}]) from None
    if not isinstance(doc, dict):
        raise SpecError("spec must be a JSON object", [{"field": "<spec>", "error": "not an object"}])
    return doc


def parse_spec(doc: dict | str | bytes, *, base_uri: str | None = None) -> JobSpec:
    """Validate a job spec given as a dict or JSON text; raise :class:`SpecError` naming every bad field.

    Only the named kind's model is imported. ``base_uri`` (the URI of the spec file) resolves ``./`` and
    ``../`` URI fields against the file's location.
    """
    from shardfold.functions import kinds

    doc = load_document(doc)
    kind = kinds.find(doc.get("kind"))
    try:
        return kind.spec.model_validate(doc, context={"base_uri": base_uri} if base_uri else None)
    except ValidationError as exc:
        errors = describe_errors(exc, model=kind.spec)
        summary = "; ".join(f"{e['field']}: {e['error']}" for e in errors)
        raise SpecError(f"invalid {kind.name} spec: {summary}", errors) from exc


def dump_spec(spec: JobSpec) -> dict:
    """The canonical JSON document of a spec (what ``jobs/<id>/spec.json`` holds; parses back equal)."""
    return spec.model_dump(mode="json", exclude_none=True)
