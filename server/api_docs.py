"""GET /docs: the HTTP API's reference as one static HTML page, drawn on the daemon from its own OpenAPI
document. It needs no token (like the operator page, it holds no data: only what docs/daemon.md says of the
API) and loads nothing from elsewhere (FastAPI's Swagger UI fetched its assets from a CDN and, behind the
token check, answered a browser with a 401). The machine-readable document stays at GET /openapi.json, which
takes a token like every other read."""

from __future__ import annotations

import html
import json
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

DOCS_PATH = "/docs"
_HEADERS = {"Content-Security-Policy": "default-src 'none'; style-src 'self'; base-uri 'none'; form-action 'none'; "
                                       "frame-ancestors 'none'",
            "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
_METHODS = ("get", "post", "put", "patch", "delete")
_INTRO = ("<p>Every operation but <code>GET /health</code> needs <code>Authorization: Bearer &lt;token&gt;</code> "
          "(401 without a valid one); writes need the operator's token (403 with another role's). The same, as "
          "OpenAPI 3 for tools: <code>GET /openapi.json</code> with a token, e.g. <code>curl -H \"Authorization: "
          "Bearer $TOKEN\" http://HOST:PORT/openapi.json</code>. The lifecycle, the ZMQ messages and the agents: "
          "docs/daemon.md.</p>")


def add_api_docs(app: FastAPI) -> None:
    """GET and HEAD /docs (the app must be created with ``docs_url=None, redoc_url=None``)."""
    rendered: list[bytes] = []

    def serve() -> Response:
        if not rendered:  # drawn once, at the first request: every route is declared by then
            rendered.append(render(app.openapi()).encode())
        return Response(rendered[0], media_type="text/html; charset=utf-8", headers=_HEADERS)

    app.add_api_route(DOCS_PATH, serve, methods=["GET", "HEAD"], include_in_schema=False)


def render(spec: dict[str, Any]) -> str:
    """The page for an OpenAPI document: every operation (parameters, body, replies), then every schema."""
    info = spec.get("info", {})
    schemas = spec.get("components", {}).get("schemas", {})
    title = f"{_e(info.get('title', 'API'))} HTTP API"
    version = f"version {_e(info.get('version', ''))}"
    out = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="referrer" content="no-referrer">', f"<title>{title}</title>",
           '<link rel="stylesheet" href="/page/page.css"></head><body class="api-docs">',
           f'<header><h1>{title}</h1><span class="muted">{version}</span></header>',
           f"<p>{_e(info.get('description', ''))}</p>", _INTRO, "<h2>Operations</h2>", '<ul class="api-index">']
    operations = [(path, method, item[method]) for path, item in spec.get("paths", {}).items()
                  for method in _METHODS if method in item]
    out += [f'<li><a href="#{_anchor(method, path)}"><code>{method.upper()} {_e(path)}</code></a> '
            f"{_e(op.get('summary', ''))}</li>" for path, method, op in operations]
    out.append("</ul>")
    for path, method, op in operations:
        out += _operation(path, method, op)
    out.append("<h2>Schemas</h2>")
    for name, schema in sorted(schemas.items()):
        out += _schema(name, schema)
    out.append("</body></html>")
    return "\n".join(out)


def _operation(path: str, method: str, op: dict[str, Any]) -> list[str]:
    out = [f'<section class="api-op" id="{_anchor(method, path)}">',
           f"<h3><code>{method.upper()} {_e(path)}</code> {_e(op.get('summary', ''))}</h3>"]
    if op.get("description"):
        out.append(f"<p>{_e(op['description'])}</p>")
    params = op.get("parameters", [])
    if params:
        out.append("<table><thead><tr><th>parameter</th><th>in</th><th>type</th><th>required</th>"
                   "<th>meaning</th></tr></thead><tbody>")
        out += [f"<tr><td><code>{_e(p.get('name'))}</code></td><td>{_e(p.get('in'))}</td>"
                f"<td>{_type(p.get('schema', {}))}</td><td>{'yes' if p.get('required') else ''}</td>"
                f"<td>{_e(p.get('description') or p.get('schema', {}).get('description', ''))}</td></tr>"
                for p in params]
        out.append("</tbody></table>")
    body = op.get("requestBody")
    if body:
        kinds = body.get("content", {})
        shown = ", ".join(f"{_e(kind)} {_type(c.get('schema', {}))}" for kind, c in kinds.items())
        out.append(f"<p>Body{' (required)' if body.get('required') else ''}: {shown}</p>")
    out.append("<table><thead><tr><th>reply</th><th>meaning</th><th>body</th></tr></thead><tbody>")
    for status, reply in op.get("responses", {}).items():
        kinds = reply.get("content", {})
        shown = ", ".join(_type(c.get("schema", {})) for c in kinds.values())
        out.append(f"<tr><td>{_e(status)}</td><td>{_e(reply.get('description', ''))}</td><td>{shown}</td></tr>")
    out += ["</tbody></table>", "</section>"]
    return out


def _schema(name: str, schema: dict[str, Any]) -> list[str]:
    out = [f'<section class="api-schema" id="schema-{_e(name)}"><h3>{_e(name)}</h3>']
    if schema.get("description"):
        out.append(f"<p>{_e(schema['description'])}</p>")
    properties = schema.get("properties")
    if properties:
        required = set(schema.get("required", []))
        out.append("<table><thead><tr><th>field</th><th>type</th><th>required</th><th>meaning</th></tr></thead>"
                   "<tbody>")
        out += [f"<tr><td><code>{_e(field)}</code></td><td>{_type(sub)}</td>"
                f"<td>{'yes' if field in required else ''}</td><td>{_e(sub.get('description', ''))}</td></tr>"
                for field, sub in properties.items()]
        out.append("</tbody></table>")
    else:
        out.append(f"<p>{_type(schema)}</p>")
    out.append("</section>")
    return out


def _type(schema: dict[str, Any]) -> str:
    """A schema as a short phrase (HTML): a link for a named schema, ``array of X``, ``A or B``, limits."""
    if not isinstance(schema, dict):
        return ""
    if "$ref" in schema:
        name = str(schema["$ref"]).rsplit("/", 1)[-1]
        return f'<a href="#schema-{_e(name)}">{_e(name)}</a>'
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return " or ".join(_type(s) for s in schema[key])
    kind = schema.get("type")
    if kind == "array":
        text = f"array of {_type(schema.get('items', {}))}"
    elif kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        text = f"object of {_type(schema['additionalProperties'])}"
    else:
        text = _e(kind or "any")
    if "enum" in schema:
        text += ": " + ", ".join(f"<code>{_e(v)}</code>" for v in schema["enum"])
    limits = [f"{label} {_e(schema[key])}" for key, label in (("minimum", "≥"), ("maximum", "≤"),
                                                             ("exclusiveMinimum", ">"), ("exclusiveMaximum", "<"),
                                                             ("maxLength", "length ≤")) if key in schema]
    if "default" in schema:
        limits.append(f"default <code>{_e(json.dumps(schema['default']))}</code>")
    return text + (f" ({', '.join(limits)})" if limits else "")


def _anchor(method: str, path: str) -> str:
    return _e(f"{method}-{path}".replace("/", "-").replace("{", "").replace("}", ""))


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


__all__ = ["DOCS_PATH", "add_api_docs", "render"]
