#pragma once
// JSON text the way Python's json.dumps(obj, ensure_ascii=False) writes it (", " and ": "
// separators, insertion order, optional indent) - what Jinja's `tojson` puts into Hugging
// Face chat templates, so that our native chat formats reproduce them byte for byte.
#include <nlohmann/json.hpp>
#include <string>

namespace spark::tok {

/// Ordered JSON (keeps the key order of the request, as Python dicts do).
using Json = nlohmann::ordered_json;

/// json.dumps(j, ensure_ascii=False) with indent < 0, or json.dumps(j, indent=indent).
std::string py_dumps(const Json& j, int indent = -1);

}  // namespace spark::tok
