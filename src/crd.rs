//! The inferencecache custom resources (`inferencecache.io/v1alpha1`), one file per kind.
//!
//! These types are the declarative surface of the product in both worlds: the
//! Kubernetes adapters read them from the apiserver, and file mode
//! (`serve --config PATH`) reads the same YAML from disk. The schema defaults are
//! also the serde defaults, so an object read from a file behaves as the apiserver
//! would have materialized it.
//!
//! ```text
//!  CachePolicy ─┐
//!  CacheTenant ─┼─▶ adapters::resolve ─▶ core::snapshot::PolicySnapshot
//!  CacheBackend ┘
//!  InferencePool (GIE's, read only) ─▶ a CacheBackend's replicas
//!  PromptTemplate, PDTopology: contract only (no reconciler yet)
//!  CacheIndex: status-only, written by the controller
//!  objects: the routing objects a policy source yields (file or cluster)
//!  data_parallel: a CacheBackend's rank endpoints and their validation
//! ```
//!
//! [`all`] and [`render_yaml`] produce the CRD manifests (`inferencecache crds`);
//! they are generated from these types and never edited by hand.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

pub mod cache_backend;
pub mod cache_index;
pub mod cache_policy;
pub mod cache_tenant;
pub mod data_parallel;
pub mod inference_pool;
pub mod objects;
pub mod openapi;
pub mod pd_topology;
pub mod prompt_template;

#[cfg(test)]
mod schema_tests;

/// Test fixture shared by the kinds' tests: an object of kind `K` named `obj` in
/// namespace `ns` with the given spec, deserialized as the apiserver would hand it.
#[cfg(test)]
pub(crate) fn mk_object<K>(spec: serde_json::Value) -> K
where
    K: kube::Resource<DynamicType = ()> + serde::de::DeserializeOwned,
{
    serde_json::from_value(serde_json::json!({
        "apiVersion": K::api_version(&()), "kind": K::kind(&()),
        "metadata": {"name": "obj", "namespace": "ns"}, "spec": spec,
    }))
    .expect("a well-formed test object")
}

/// The standard Kubernetes condition, shared by every status.
pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

/// API group of every kind.
pub const GROUP: &str = "inferencecache.io";
/// The only served version.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` of every object.
pub const API_VERSION: &str = "inferencecache.io/v1alpha1";

/// Every CRD of the product, in a stable order.
pub fn all() -> Vec<CustomResourceDefinition> {
    vec![
        cache_policy::CachePolicy::crd(),
        cache_tenant::CacheTenant::crd(),
        cache_backend::CacheBackend::crd(),
        prompt_template::PromptTemplate::crd(),
        pd_topology::PDTopology::crd(),
        cache_index::crd(),
    ]
}

/// All CRDs as one multi-document YAML stream, for `inferencecache crds`.
pub fn render_yaml() -> Result<String, serde_saphyr::SerializeError> {
    let mut out = String::new();
    for crd in all() {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(&crd)?);
        if !out.ends_with('\n') {
            out.push('\n');
        }
    }
    Ok(out)
}

/// Shared by the serde defaults of boolean fields that default to `true`.
pub(crate) fn default_true() -> bool {
    true
}
