"""JSON values as types: what ``json.loads`` returns and ``json.dumps`` accepts.

A leaf module (it imports nothing); use these aliases instead of ``Any`` for request bodies,
response payloads and other JSON-shaped data.
"""

JSONScalar = str | int | float | bool | None
JSONValue = JSONScalar | list["JSONValue"] | dict[str, "JSONValue"]
JSONObject = dict[str, JSONValue]
