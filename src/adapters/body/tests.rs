//! Body mode: every fallback, and chains that equal the ones the index builds.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::*;
use crate::adapters::policy_file::{self, Loaded};
use crate::core::index::IndexConfig;
use crate::core::time::Timestamp;

/// A word-level tokenizer: `<s>` (0, added by the post-processor), `<|user|>` (1),
/// `<|assistant|>` (2), `<unk>` (3), and `w0`..`w99` as 10..109.
fn tokenizer_json() -> String {
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<s>", "<|user|>", "<|assistant|>", "<unk>"]
        .iter()
        .enumerate()
    {
        vocab.insert(t.to_string(), i.into());
    }
    for i in 0..100 {
        vocab.insert(format!("w{i}"), (10 + i).into());
    }
    let added = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [added(0, "<s>"), added(1, "<|user|>"), added(2, "<|assistant|>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    })
    .to_string()
}

/// A template that writes BOS itself (as Llama's do).
const TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ m.content }} {% elif m.role == 'user' %}<|user|> {{ m.content }} {% elif m.role == 'assistant' %}<|assistant|> {{ m.content }} {% else %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";

struct Fixture {
    root: PathBuf,
}

impl Fixture {
    fn new(name: &str) -> Self {
        let root = std::env::temp_dir().join(format!("ic-body-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("tok")).unwrap();
        std::fs::create_dir_all(root.join("policy")).unwrap();
        std::fs::write(root.join("tok/tokenizer.json"), tokenizer_json()).unwrap();
        std::fs::write(
            root.join("tok/tokenizer_config.json"),
            serde_json::json!({"bos_token": {"content": "<s>"}, "chat_template": TEMPLATE})
                .to_string(),
        )
        .unwrap();
        Self { root }
    }

    fn tok(&self) -> PathBuf {
        self.root.join("tok")
    }

    /// Policy: namespace a (tenant ta) and b (tenant tb); `backends` are
    /// (namespace, name, model, scheme, tokenizer dir) with block size 4.
    fn load(&self, backends: &[(&str, &str, &str, &str, Option<&Path>)]) -> Loaded {
        let mut yaml = String::new();
        for (ns, t) in [("a", "ta"), ("b", "tb")] {
            yaml.push_str(&format!(
                "apiVersion: inferencecache.io/v1alpha1\nkind: CacheTenant\nmetadata: {{name: t, namespace: {ns}}}\nspec: {{tenantID: {t}}}\n---\n"
            ));
        }
        for (ns, name, model, scheme, tok) in backends {
            let tok = tok
                .map(|p| format!(", tokenizer: {{path: {:?}}}", p.display().to_string()))
                .unwrap_or_default();
            yaml.push_str(&format!(
                "apiVersion: inferencecache.io/v1alpha1\nkind: CacheBackend\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: {{engine: vLLM, modelID: {model}, hashScheme: {scheme}, blockSize: 4{tok}}}\n---\n"
            ));
        }
        let file = self.root.join("policy/p.yaml");
        std::fs::write(&file, yaml).unwrap();
        policy_file::load(&file).unwrap()
    }

    fn mode(&self, loaded: &Loaded, max: usize) -> (BodyMode, Arc<TokenizerStore>) {
        let store = Arc::new(TokenizerStore::default());
        store.set(loaded.objects.each_backend());
        store.refresh();
        let router = Arc::new(Router::new(
            IndexConfig::default(),
            crate::core::snapshot::PolicySnapshot::empty(),
            Timestamp::now(),
        ));
        (BodyMode::new(router, store.clone(), max), store)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

const COMPLETIONS: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";

fn no_headers() -> RoutingFields {
    RoutingFields::default()
}

fn words(range: std::ops::Range<u32>) -> String {
    range.map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ")
}

fn expected(ids: &[u32]) -> Vec<u64> {
    chain::compute_chain(Scheme::ContentV1, ids, 4, None).unwrap()
}

#[test]
fn completions_text_is_encoded_with_special_tokens_and_chained_per_block() {
    let f = Fixture::new("completions");
    let loaded = f.load(&[("a", "be", "m", IC_CONTENT_V1, Some(&f.tok()))]);
    let (mode, _) = f.mode(&loaded, 1 << 20);
    let body = serde_json::json!({"model": "m", "prompt": words(0..10)}).to_string();
    let out = mode
        .route_in(
            &loaded.snapshot,
            COMPLETIONS,
            &no_headers(),
            body.as_bytes(),
        )
        .unwrap();
    // <s> then w0..w9: 11 tokens, two full blocks of 4.
    let ids: Vec<u32> = std::iter::once(0).chain(10..20).collect();
    assert_eq!(out.block_hashes, expected(&ids));
    assert_eq!(out.block_hashes.len(), 2);
    assert_eq!(out.block_token_counts, vec![4, 4]);
    assert_eq!((out.tenant.as_str(), out.model.as_str()), ("ta", "m"));
    assert_eq!(out.hash_scheme, IC_CONTENT_V1);

    // add_special_tokens: false drops the BOS, so the chain differs.
    let body =
        serde_json::json!({"model": "m", "prompt": words(0..10), "add_special_tokens": false});
    let out = mode
        .route_in(
            &loaded.snapshot,
            COMPLETIONS,
            &no_headers(),
            body.to_string().as_bytes(),
        )
        .unwrap();
    assert_eq!(out.block_hashes, expected(&(10..20).collect::<Vec<_>>()));
}

#[test]
fn token_id_prompts_are_used_as_they_are_and_a_list_routes_on_its_first_prompt() {
    let f = Fixture::new("tokens");
    let loaded = f.load(&[("a", "be", "m", IC_CONTENT_V1, Some(&f.tok()))]);
    let (mode, _) = f.mode(&loaded, 1 << 20);
    let route = |body: serde_json::Value| {
        mode.route_in(
            &loaded.snapshot,
            COMPLETIONS,
            &no_headers(),
            body.to_string().as_bytes(),
        )
    };
    let ids: Vec<u32> = (500..509).collect();
    let one = route(serde_json::json!({"model": "m", "prompt": ids})).unwrap();
    assert_eq!(one.block_hashes, expected(&ids));
    let batch = route(serde_json::json!({"model": "m", "prompt": [ids, [1, 2, 3, 4, 5]]})).unwrap();
    assert_eq!(batch.block_hashes, one.block_hashes);
    let texts =
        route(serde_json::json!({"model": "m", "prompt": [words(0..7), words(50..60)]})).unwrap();
    let first: Vec<u32> = std::iter::once(0).chain(10..17).collect();
    assert_eq!(texts.block_hashes, expected(&first));
    let e = route(serde_json::json!({"model": "m", "prompt": []})).unwrap_err();
    assert_eq!(e.reason(), "not_openai");
    let e = route(serde_json::json!({"model": "m", "prompt": {"x": 1}})).unwrap_err();
    assert_eq!(e.reason(), "not_openai");
}

#[test]
fn chat_is_rendered_with_the_template_and_bos_is_not_added_twice() {
    let f = Fixture::new("chat");
    let loaded = f.load(&[("a", "be", "m", IC_CONTENT_V1, Some(&f.tok()))]);
    let (mode, _) = f.mode(&loaded, 1 << 20);
    let body = serde_json::json!({"model": "m", "messages": [
        {"role": "system", "content": words(0..3)},
        {"role": "user", "content": [{"type": "text", "text": "w5"}, {"type": "text", "text": "w6"}]},
    ]});
    let out = mode
        .route_in(
            &loaded.snapshot,
            CHAT,
            &no_headers(),
            body.to_string().as_bytes(),
        )
        .unwrap();
    // <s> w0 w1 w2 <|user|> w5 w6 <|assistant|>: one BOS (the template's), text
    // parts joined by a newline, the generation prompt.
    let ids = [0, 10, 11, 12, 1, 15, 16, 2];
    assert_eq!(out.block_hashes, expected(&ids));

    let body = serde_json::json!({"model": "m", "add_generation_prompt": false,
        "messages": [{"role": "user", "content": words(0..7)}]});
    let out = mode
        .route_in(
            &loaded.snapshot,
            CHAT,
            &no_headers(),
            body.to_string().as_bytes(),
        )
        .unwrap();
    assert_eq!(
        out.block_hashes,
        expected(&[0, 1, 10, 11, 12, 13, 14, 15, 16])
    );
}

#[test]
fn the_header_model_wins_over_the_body_and_the_header_tenant_disambiguates() {
    let f = Fixture::new("tenant");
    let loaded = f.load(&[
        ("a", "be", "m", IC_CONTENT_V1, Some(&f.tok())),
        ("b", "be", "m", IC_CONTENT_V1, Some(&f.tok())),
        ("b", "other", "mn", IC_CONTENT_V1, Some(&f.tok())),
    ]);
    let (mode, _) = f.mode(&loaded, 1 << 20);
    let body = serde_json::json!({"model": "m", "prompt": words(0..8)}).to_string();
    let e = mode
        .route_in(
            &loaded.snapshot,
            COMPLETIONS,
            &no_headers(),
            body.as_bytes(),
        )
        .unwrap_err();
    assert_eq!(e, BodyMiss::AmbiguousTenant("m".into()));
    let headers = RoutingFields {
        tenant: "tb".into(),
        ..RoutingFields::default()
    };
    let out = mode
        .route_in(&loaded.snapshot, COMPLETIONS, &headers, body.as_bytes())
        .unwrap();
    assert_eq!((out.tenant.as_str(), out.model.as_str()), ("tb", "m"));
    // The header's model stands; mn is served by tb only.
    let headers = RoutingFields {
        model: "mn".into(),
        ..RoutingFields::default()
    };
    let out = mode
        .route_in(&loaded.snapshot, COMPLETIONS, &headers, body.as_bytes())
        .unwrap();
    assert_eq!((out.tenant.as_str(), out.model.as_str()), ("tb", "mn"));
    // A tenant that does not serve the model.
    let headers = RoutingFields {
        tenant: "ta".into(),
        model: "mn".into(),
        ..RoutingFields::default()
    };
    let e = mode
        .route_in(&loaded.snapshot, COMPLETIONS, &headers, body.as_bytes())
        .unwrap_err();
    assert_eq!(e, BodyMiss::UnknownModel("mn".into()));
}

#[test]
fn every_fallback_has_its_reason() {
    let f = Fixture::new("fallbacks");
    let broken = f.root.join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::write(broken.join("tokenizer.json"), "{not json").unwrap();
    let bad_template = f.root.join("bad-template");
    std::fs::create_dir_all(&bad_template).unwrap();
    std::fs::write(bad_template.join("tokenizer.json"), tokenizer_json()).unwrap();
    let loaded = f.load(&[
        ("a", "be", "m", IC_CONTENT_V1, Some(&f.tok())),
        ("a", "none", "untokenized", IC_CONTENT_V1, None),
        ("a", "broken", "broken", IC_CONTENT_V1, Some(&broken)),
        (
            "a",
            "notemplate",
            "notemplate",
            IC_CONTENT_V1,
            Some(&bad_template),
        ),
        ("a", "cbor", "cbor", "vllm-sha256-cbor", Some(&f.tok())),
    ]);
    let (mode, store) = f.mode(&loaded, 200);
    let route = |path: &str, body: &str| {
        mode.route_in(&loaded.snapshot, path, &no_headers(), body.as_bytes())
            .unwrap_err()
    };
    let prompt = |model: &str| serde_json::json!({"model": model, "prompt": "w1"}).to_string();
    let chat = |model: &str, role: &str| {
        serde_json::json!({"model": model, "messages": [{"role": role, "content": "w1"}]})
            .to_string()
    };
    assert_eq!(
        route(
            COMPLETIONS,
            &format!(
                "{{\"model\": \"m\", \"prompt\": \"{}\"}}",
                "w1 ".repeat(100)
            )
        ),
        BodyMiss::TooLarge { limit: 200 }
    );
    assert_eq!(route(COMPLETIONS, "{\"model\": ").reason(), "invalid_json");
    assert_eq!(route(COMPLETIONS, "[1, 2]").reason(), "not_openai");
    assert_eq!(
        route(COMPLETIONS, "{\"model\": \"m\"}").reason(),
        "not_openai"
    );
    assert_eq!(
        route(CHAT, "{\"model\": \"m\", \"messages\": []}").reason(),
        "not_openai"
    );
    assert_eq!(
        route(
            CHAT,
            "{\"model\": \"m\", \"messages\": [{\"content\": \"x\"}]}"
        )
        .reason(),
        "not_openai"
    );
    assert_eq!(route("/v1/embeddings", &prompt("m")).reason(), "not_openai");
    assert_eq!(
        route(COMPLETIONS, "{\"prompt\": \"w1\"}").reason(),
        "not_openai"
    );
    assert_eq!(
        route(COMPLETIONS, &prompt("unknown")),
        BodyMiss::UnknownModel("unknown".into())
    );
    let e = route(COMPLETIONS, &prompt("untokenized"));
    assert!(
        matches!(&e, BodyMiss::NoTokenizer { backend, detail }
        if backend == "a/none" && detail.contains("no spec.tokenizer")),
        "{e:?}"
    );
    let e = route(COMPLETIONS, &prompt("broken"));
    assert!(
        matches!(&e, BodyMiss::NoTokenizer { detail, .. } if detail.contains("tokenizer.json")),
        "{e:?}"
    );
    let e = route(COMPLETIONS, &prompt("cbor"));
    assert!(
        matches!(&e, BodyMiss::NoTokenizer { detail, .. } if detail.contains("hashScheme")),
        "{e:?}"
    );
    let e = route(CHAT, &chat("m", "tool"));
    assert!(
        matches!(&e, BodyMiss::Template(d) if d.contains("unknown role tool")),
        "{e:?}"
    );
    let e = route(CHAT, &chat("notemplate", "user"));
    assert!(
        matches!(&e, BodyMiss::Template(d) if d.contains("no chat template")),
        "{e:?}"
    );
    // A template-less tokenizer still serves completions.
    assert!(
        mode.route_in(
            &loaded.snapshot,
            COMPLETIONS,
            &no_headers(),
            prompt("notemplate").as_bytes()
        )
        .is_ok()
    );
    // The broken directory is a configuration error; the others are not.
    let problems = store.problems();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].starts_with("CacheBackend a/broken: spec.tokenizer.path"),
        "{problems:?}"
    );
}

#[test]
fn wants_body_only_for_openai_paths_without_a_chain_and_with_body_mode_configured() {
    let f = Fixture::new("wants");
    let loaded = f.load(&[("a", "be", "m", IC_CONTENT_V1, Some(&f.tok()))]);
    let (mode, store) = f.mode(&loaded, 1 << 20);
    assert!(mode.wants_body(COMPLETIONS, &no_headers()));
    assert!(mode.wants_body("/v1/chat/completions?x=1", &no_headers()));
    assert!(!mode.wants_body("/v1/models", &no_headers()));
    let chained = RoutingFields {
        block_hashes: vec![1],
        block_token_counts: vec![4],
        ..RoutingFields::default()
    };
    assert!(!mode.wants_body(COMPLETIONS, &chained));
    let prefixed = RoutingFields {
        prefix_hash: "ab".into(),
        ..RoutingFields::default()
    };
    assert!(!mode.wants_body(COMPLETIONS, &prefixed));
    store.set(&[]);
    assert!(!mode.wants_body(COMPLETIONS, &no_headers()));
    assert_eq!(mode.max_body_bytes(), 1 << 20);
}

#[test]
fn a_changed_tokenizer_is_reloaded_and_a_broken_one_falls_back() {
    let f = Fixture::new("reload");
    let loaded = f.load(&[("a", "be", "m", IC_CONTENT_V1, Some(&f.tok()))]);
    let (mode, store) = f.mode(&loaded, 1 << 20);
    let body =
        serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "w1 w2 w3"}]})
            .to_string();
    let before = mode
        .route_in(&loaded.snapshot, CHAT, &no_headers(), body.as_bytes())
        .unwrap();
    // A new template (no BOS, longer): a different chain after refresh. Sizes
    // differ, so the change is seen even within the same mtime second.
    std::fs::write(
        f.tok().join("chat_template.jinja"),
        "{% for m in messages %}<|user|> {{ m.content }} w9 {% endfor %}",
    )
    .unwrap();
    store.refresh();
    let after = mode
        .route_in(&loaded.snapshot, CHAT, &no_headers(), body.as_bytes())
        .unwrap();
    assert_ne!(before.block_hashes, after.block_hashes);
    assert_eq!(after.block_hashes, expected(&[1, 11, 12, 13]));

    std::fs::write(f.tok().join("tokenizer.json"), "{}").unwrap();
    store.refresh();
    let e = mode
        .route_in(&loaded.snapshot, CHAT, &no_headers(), body.as_bytes())
        .unwrap_err();
    assert_eq!(e.reason(), "no_tokenizer");
    assert_eq!(store.problems().len(), 1);
}

#[test]
fn a_backend_not_loaded_yet_is_loading_not_an_error() {
    let f = Fixture::new("loading");
    let loaded = f.load(&[("a", "be", "m", IC_CONTENT_V1, Some(&f.tok()))]);
    let store = TokenizerStore::default();
    store.set(loaded.objects.each_backend());
    assert!(matches!(store.get("a", "be"), TokenizerState::Loading));
    assert!(store.problems().is_empty());
    store.refresh();
    assert!(matches!(store.get("a", "be"), TokenizerState::Ready(_)));
    assert!(matches!(
        store.get("a", "other"),
        TokenizerState::NotConfigured
    ));
}

#[test]
fn repeated_segments_come_from_the_cache_with_the_same_ids() {
    let f = Fixture::new("segcache");
    let tok = tokenizer::ModelTokenizer::load(&f.tok()).unwrap();
    assert_eq!(tok.cache_stats().unwrap().misses, 0);
    let text = format!(
        "<s>{} <|user|> {} <|assistant|>",
        words(0..40),
        words(40..45)
    );
    for special in [false, true] {
        let want = tok.encode_uncached(&text, special).unwrap();
        assert_eq!(tok.encode(&text, special).unwrap(), want);
        assert_eq!(tok.encode(&text, special).unwrap(), want);
    }
    // BOS from the post-processor, once, ahead of the template's own <s>.
    assert_eq!(tok.encode(&text, true).unwrap()[..2], [0, 0]);
    let s = tok.cache_stats().unwrap();
    // Two pieces between the added tokens (the words before <|user|> and the
    // words before <|assistant|>), five encodes: one miss each, then hits.
    assert_eq!((s.misses, s.hits, s.entries), (2, 8, 2));
}

#[test]
fn a_tokenizer_whose_split_depends_on_context_is_not_cached() {
    let f = Fixture::new("segcache-off");
    let mut json: serde_json::Value = serde_json::from_str(&tokenizer_json()).unwrap();
    json["added_tokens"][1]["normalized"] = true.into();
    std::fs::write(f.tok().join("tokenizer.json"), json.to_string()).unwrap();
    let tok = tokenizer::ModelTokenizer::load(&f.tok()).unwrap();
    let why = tok.cache_stats().unwrap_err();
    assert!(why.contains("<|user|>"), "{why}");
    let text = format!("{} <|user|> {}", words(0..3), words(3..5));
    assert_eq!(
        tok.encode(&text, true).unwrap(),
        tok.encode_uncached(&text, true).unwrap()
    );
}

#[test]
fn the_cache_counts_reach_metrics() {
    let f = Fixture::new("segcache-metrics");
    let loaded = f.load(&[("a", "be", "m", IC_CONTENT_V1, Some(&f.tok()))]);
    let (mode, store) = f.mode(&loaded, 1 << 20);
    let body = serde_json::json!({"model": "m", "prompt": format!("{} <|user|> w1", words(0..9))});
    for _ in 0..3 {
        mode.route_in(
            &loaded.snapshot,
            COMPLETIONS,
            &no_headers(),
            body.to_string().as_bytes(),
        )
        .unwrap();
    }
    let mut registry = prometheus_client::registry::Registry::with_prefix("inferencecache");
    registry.register_collector(Box::new(store::CacheCollector(store.clone())));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    // Two pieces (the nine words, " w1"): a miss each, then four hits.
    assert!(
        text.contains("inferencecache_body_tokenizer_cache_lookups_total{result=\"hit\"} 4"),
        "{text}"
    );
    assert!(text.contains("inferencecache_body_tokenizer_cache_lookups_total{result=\"miss\"} 2"));
    assert!(text.contains("inferencecache_body_tokenizer_cache_bytes "));
}

/// One backend in namespace a (tenant ta) with `spec` as its spec's extra fields.
fn load_one(f: &Fixture, scheme: &str, extra: &str) -> Loaded {
    let yaml = format!(
        "apiVersion: inferencecache.io/v1alpha1\nkind: CacheTenant\nmetadata: {{name: t, namespace: a}}\nspec: {{tenantID: ta}}\n---\napiVersion: inferencecache.io/v1alpha1\nkind: CacheBackend\nmetadata: {{name: be, namespace: a}}\nspec: {{engine: vLLM, modelID: m, hashScheme: {scheme}, blockSize: 4, tokenizer: {{path: {:?}}}{extra}}}\n",
        f.tok().display().to_string()
    );
    let file = f.root.join("policy/p.yaml");
    std::fs::write(&file, yaml).unwrap();
    policy_file::load(&file).unwrap()
}

#[test]
fn under_ic_content_v2_an_adapter_model_and_a_cache_salt_are_the_block_identity() {
    let f = Fixture::new("identity-v2");
    let loaded = load_one(&f, IC_CONTENT_V2, ", loraAdapters: [sql-lora]");
    let (mode, _) = f.mode(&loaded, 1 << 20);
    let route = |headers: &RoutingFields, body: serde_json::Value| {
        mode.route_in(
            &loaded.snapshot,
            COMPLETIONS,
            headers,
            body.to_string().as_bytes(),
        )
    };
    let ids: Vec<u32> = std::iter::once(0).chain(10..20).collect();
    let plain = chain::compute_chain(Scheme::ContentV2, &ids, 4, None).unwrap();

    let base = route(
        &no_headers(),
        serde_json::json!({"model": "m", "prompt": words(0..10)}),
    )
    .unwrap();
    assert_eq!(
        (base.model.as_str(), base.hash_scheme.as_str()),
        ("m", IC_CONTENT_V2)
    );
    assert_eq!(
        (base.lora_adapter.as_str(), base.cache_salt.as_str()),
        ("", "")
    );
    assert_eq!(base.block_hashes, plain);

    // The adapter's name as the model: the base model's scope, the adapter as
    // identity (the router mixes it into the index keys), the plain chain.
    let lora = route(
        &no_headers(),
        serde_json::json!({"model": "sql-lora", "prompt": words(0..10), "cache_salt": "t-7"}),
    )
    .unwrap();
    assert_eq!((lora.tenant.as_str(), lora.model.as_str()), ("ta", "m"));
    assert_eq!(
        (lora.lora_adapter.as_str(), lora.cache_salt.as_str()),
        ("sql-lora", "t-7")
    );
    assert_eq!(lora.block_hashes, plain);

    // Under a base-model header the body's adapter still counts; identity
    // headers win over the body.
    let header_model = RoutingFields {
        model: "m".into(),
        ..RoutingFields::default()
    };
    let out = route(
        &header_model,
        serde_json::json!({"model": "sql-lora", "prompt": words(0..10)}),
    )
    .unwrap();
    assert_eq!(out.lora_adapter, "sql-lora");
    let forced = RoutingFields {
        lora_adapter: "other".into(),
        cache_salt: "h".into(),
        ..RoutingFields::default()
    };
    let out = route(
        &forced,
        serde_json::json!({"model": "sql-lora", "prompt": words(0..10), "cache_salt": "b"}),
    )
    .unwrap();
    assert_eq!(
        (out.lora_adapter.as_str(), out.cache_salt.as_str()),
        ("other", "h")
    );

    // A chat request carries its salt too.
    let chat = serde_json::json!({"model": "sql-lora", "cache_salt": "s",
        "messages": [{"role": "user", "content": words(0..10)}]});
    let out = mode
        .route_in(
            &loaded.snapshot,
            CHAT,
            &no_headers(),
            chat.to_string().as_bytes(),
        )
        .unwrap();
    assert_eq!(
        (out.lora_adapter.as_str(), out.cache_salt.as_str()),
        ("sql-lora", "s")
    );

    // An adapter nobody declares is an unknown model, as before.
    let miss = route(
        &no_headers(),
        serde_json::json!({"model": "nope-lora", "prompt": "w1"}),
    )
    .unwrap_err();
    assert_eq!(miss.reason(), "unknown_model");
}

#[test]
fn under_ic_content_v1_an_adapter_routes_in_its_backend_without_identity() {
    // ic-content-v1 hashes token ids only, as its engine-side chain does: an
    // identity here would match nothing the index holds.
    let f = Fixture::new("identity-v1");
    let loaded = load_one(&f, IC_CONTENT_V1, ", loraAdapters: [sql-lora]");
    let (mode, _) = f.mode(&loaded, 1 << 20);
    let body = serde_json::json!({"model": "sql-lora", "prompt": words(0..10), "cache_salt": "x"});
    let out = mode
        .route_in(
            &loaded.snapshot,
            COMPLETIONS,
            &no_headers(),
            body.to_string().as_bytes(),
        )
        .unwrap();
    assert_eq!(
        (out.model.as_str(), out.hash_scheme.as_str()),
        ("m", IC_CONTENT_V1)
    );
    assert_eq!(
        (out.lora_adapter.as_str(), out.cache_salt.as_str()),
        ("", "")
    );
    let ids: Vec<u32> = std::iter::once(0).chain(10..20).collect();
    assert_eq!(out.block_hashes, expected(&ids));
}
