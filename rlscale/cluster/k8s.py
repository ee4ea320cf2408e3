"""Kubernetes value checks for the cluster config: quantities, DNS names, labels, durations."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_QUANTITY = re.compile(r"^(?P<num>[+]?(\d+(\.\d*)?|\.\d+))(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][+-]?\d+)?$")
_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
DURATION = re.compile(r"^\d+(ms|s|m|h)$")


def parse_quantity(text: str) -> Decimal:
    """A Kubernetes resource quantity ('1000Gi', '500m', '8') as a number; ValueError if malformed."""
    match = _QUANTITY.match(str(text).strip())
    if not match:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 8, 500m, 64Gi, 1000Gi)")
    number, suffix = Decimal(match["num"]), match["suffix"] or ""
    if suffix[:1] in ("e", "E"):
        return number * (Decimal(10) ** int(suffix[1:]))
    return number * Decimal(_SUFFIX.get(suffix, 1))


def quantity(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        raise ValueError(f"expected a Kubernetes quantity, got {value!r}")
    text = str(value).strip()
    try:
        if parse_quantity(text) <= 0:
            raise ValueError(f"{text!r} must be greater than zero")
    except InvalidOperation:
        raise ValueError(f"{text!r} is not a Kubernetes quantity") from None
    return text


def dns_label(value: str, what: str, max_len: int = 63, rfc1035: bool = False) -> str:
    pattern = DNS1035_LABEL if rfc1035 else DNS1123_LABEL
    if len(value) > max_len or not pattern.match(value):
        first = "a letter" if rfc1035 else "a letter or digit"
        raise ValueError(f"{value!r} is not a valid {what}: at most {max_len} lowercase letters, digits "
                         f"and '-', starting with {first} and ending with a letter or digit")
    return value


def dns_subdomain(value: str, what: str) -> str:
    """An object name such as a PVC's or a Secret's: DNS-1123 labels joined by dots, at most 253."""
    if len(value) > 253 or not all(DNS1123_LABEL.match(part) for part in value.split(".")):
        raise ValueError(f"{value!r} is not a valid {what}: at most 253 lowercase letters, digits, '-' and '.', "
                         "each dot-separated part starting and ending with a letter or digit")
    return value


def duration(value: str) -> str:
    if not DURATION.match(value):
        raise ValueError(f"{value!r} is not a duration such as 30s or 1m")
    return value
