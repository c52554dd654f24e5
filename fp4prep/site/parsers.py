"""The API's JSON parser.

Its own module, importing nothing of DRF's views: DRF reads ``DEFAULT_PARSER_CLASSES`` while it
defines ``APIView``, so a parser in a module that imports ``rest_framework.views`` (as ``api.py``
does) would be imported half-initialized, depending on which module Django imports first.
"""

from __future__ import annotations

from typing import Any

from rest_framework import exceptions, parsers

from fp4prep.text import parse_json


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, with every bad body a 400 that says what is wrong: one nested past
    Python's recursion limit or holding a 5000-digit number too (a 500 and an interpreter hint in
    DRF's). The body was bounded before the view (``FP4PREP_REQUEST_MAX_BYTES``)."""

    def parse(self, stream: Any, media_type: Any = None, parser_context: Any = None) -> Any:
        data = stream.read() if stream is not None else b""
        try:
            return parse_json(data, constants=False)
        except ValueError as exc:
            raise exceptions.ParseError(f"Request body is not valid JSON: {exc}") from None
