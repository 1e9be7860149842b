//! Checks an object against one of our CRDs' structural openAPI v3 schemas, the
//! way the apiserver would before any CEL rule runs: types, required fields, enums,
//! patterns, numeric bounds, string and list lengths, and unknown fields (the
//! apiserver's strict field validation). There is no apiserver in CI and none in
//! front of the admission webhook's tests, so this is what catches a typo in a
//! manifest or a review object.
//!
//! The schema is taken as JSON (the serialized `openAPIV3Schema`) so the walk is
//! one small recursive function over the keywords our generated CRDs use:
//!
//! ```text
//!  type · nullable · required · properties · additionalProperties · items
//!  enum · pattern · minimum · maximum · minLength · maxLength · maxItems
//!  x-kubernetes-preserve-unknown-fields · x-kubernetes-int-or-string
//! ```
//!
//! Top-level `apiVersion`, `kind` and `metadata` belong to the apiserver, not the
//! CRD schema, and are skipped.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use regex::Regex;
use serde_json::Value;

/// One schema violation: the dotted field path (`spec.strategy.requireChain`,
/// `spec.slots[0].name`) and what is wrong there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// The `openAPIV3Schema` of the CRD's first (only) version, as JSON.
pub fn schema_of(crd: &CustomResourceDefinition) -> Option<Value> {
    crd.spec
        .versions
        .first()?
        .schema
        .as_ref()?
        .open_api_v3_schema
        .as_ref()
        .and_then(|s| serde_json::to_value(s).ok())
}

/// Every violation of `object` (a whole custom resource) against `schema`.
pub fn validate(schema: &Value, object: &Value) -> Vec<Violation> {
    let mut out = Vec::new();
    walk(schema, object, "", &mut out);
    out
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn walk(schema: &Value, value: &Value, path: &str, out: &mut Vec<Violation>) {
    let mut push = |message: String| {
        out.push(Violation {
            path: if path.is_empty() {
                "<root>".into()
            } else {
                path.to_string()
            },
            message,
        })
    };
    if value.is_null() {
        if schema.get("nullable") != Some(&Value::Bool(true)) {
            push("must not be null".into());
        }
        return;
    }
    if schema.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true)) {
        if !(value.is_string() || value.is_i64() || value.is_u64()) {
            push(format!(
                "must be an integer or a string, got {}",
                kind_of(value)
            ));
        }
        return;
    }
    if let Some(ty) = schema.get("type").and_then(Value::as_str) {
        let ok = match ty {
            "object" => value.is_object(),
            "array" => value.is_array(),
            "string" => value.is_string(),
            "boolean" => value.is_boolean(),
            "integer" => value.is_i64() || value.is_u64(),
            "number" => value.is_number(),
            _ => true,
        };
        if !ok {
            push(format!("must be of type {ty}, got {}", kind_of(value)));
            return;
        }
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
        && !allowed.contains(value)
    {
        let list: Vec<String> = allowed.iter().map(Value::to_string).collect();
        push(format!("{value} is not one of [{}]", list.join(", ")));
    }
    match value {
        Value::Object(map) => {
            if let Some(required) = schema.get("required").and_then(Value::as_array) {
                for key in required.iter().filter_map(Value::as_str) {
                    if !map.contains_key(key) {
                        out.push(Violation {
                            path: join(path, key),
                            message: "required field is missing".into(),
                        });
                    }
                }
            }
            // Preserved unknown fields stay whole only where no
            // `additionalProperties` schema applies to the values: the apiserver
            // prunes the values by that schema (`true` is the empty schema, which
            // keeps scalars and strips the contents of nested objects).
            if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true))
                && schema.get("properties").is_none()
                && schema.get("additionalProperties").is_none()
            {
                return;
            }
            let props = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties");
            for (key, v) in map {
                if path.is_empty() && ["apiVersion", "kind", "metadata"].contains(&key.as_str()) {
                    continue;
                }
                match (props.and_then(|p| p.get(key)), additional) {
                    (Some(s), _) => walk(s, v, &join(path, key), out),
                    (None, Some(a)) if a.is_object() => walk(a, v, &join(path, key), out),
                    (None, Some(Value::Bool(true))) => {
                        walk(&Value::Object(Default::default()), v, &join(path, key), out)
                    }
                    (None, _)
                        if schema.get("x-kubernetes-preserve-unknown-fields")
                            == Some(&Value::Bool(true)) => {}
                    (None, _) => out.push(Violation {
                        path: join(path, key),
                        message: "unknown field".into(),
                    }),
                }
            }
        }
        Value::Array(items) => {
            if let Some(max) = schema.get("maxItems").and_then(Value::as_u64)
                && items.len() as u64 > max
            {
                push(format!(
                    "has {} items, more than the maximum {max}",
                    items.len()
                ));
            }
            if let Some(s) = schema.get("items") {
                for (i, v) in items.iter().enumerate() {
                    walk(s, v, &format!("{path}[{i}]"), out);
                }
            }
        }
        Value::String(s) => {
            let chars = s.chars().count() as u64;
            if let Some(min) = schema.get("minLength").and_then(Value::as_u64)
                && chars < min
            {
                push(format!("must be at least {min} characters long"));
            }
            if let Some(max) = schema.get("maxLength").and_then(Value::as_u64)
                && chars > max
            {
                push(format!("must be at most {max} characters long"));
            }
            if let Some(pattern) = schema.get("pattern").and_then(Value::as_str) {
                match Regex::new(pattern) {
                    Ok(re) if re.is_match(s) => {}
                    Ok(_) => push(format!("{s:?} does not match the pattern {pattern}")),
                    Err(e) => push(format!("schema pattern {pattern} does not compile: {e}")),
                }
            }
        }
        Value::Number(n) => {
            let Some(x) = n.as_f64() else { return };
            if let Some(min) = schema.get("minimum").and_then(Value::as_f64)
                && x < min
            {
                push(format!("{n} is below the minimum {min}"));
            }
            if let Some(max) = schema.get("maximum").and_then(Value::as_f64)
                && x > max
            {
                push(format!("{n} is above the maximum {max}"));
            }
        }
        Value::Bool(_) | Value::Null => {}
    }
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

#[cfg(test)]
mod tests;
