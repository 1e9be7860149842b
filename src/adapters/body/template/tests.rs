use super::*;

/// `v` is JSON text: parsed straight into a minijinja value, key order kept
/// (as request bodies are).
fn render_json(v: &str, kwargs: &[(&str, Value)]) -> String {
    let mut env = Environment::new();
    env.add_filter("tojson", tojson);
    let v: Value = serde_json::from_str(v).unwrap();
    let args: Vec<String> = kwargs.iter().map(|(k, _)| format!("{k}={k}")).collect();
    let src = if args.is_empty() {
        "{{ v | tojson }}".to_string()
    } else {
        format!("{{{{ v | tojson({}) }}}}", args.join(", "))
    };
    let ctx = Value::from_iter(
        kwargs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .chain([("v".to_string(), v)]),
    );
    env.render_str(&src, ctx).unwrap()
}

#[test]
fn tojson_writes_what_python_json_dumps_writes() {
    // json.dumps({"b": 1, "a": [1.5, 2.0, None, True, "é\n\"<>"]}, ensure_ascii=False)
    let v = r#"{"b": 1, "a": [1.5, 2.0, null, true, "é\n\"<>"]}"#;
    assert_eq!(
        render_json(v, &[]),
        r#"{"b": 1, "a": [1.5, 2.0, null, true, "é\n\"<>"]}"#
    );
    assert_eq!(
        render_json(v, &[("indent", Value::from(2))]),
        "{\n  \"b\": 1,\n  \"a\": [\n    1.5,\n    2.0,\n    null,\n    true,\n    \"é\\n\\\"<>\"\n  ]\n}"
    );
    assert_eq!(
        render_json(r#"{"b": {}, "a": []}"#, &[("sort_keys", Value::from(true))]),
        r#"{"a": [], "b": {}}"#
    );
    assert_eq!(
        render_json("[1e20, 1.5e-5, 0.0]", &[]),
        "[1e+20, 1.5e-05, 0.0]"
    );
}

fn chat(messages: serde_json::Value) -> Chat {
    Chat {
        messages: Value::from_serialize(&messages),
        tools: None,
        add_generation_prompt: true,
        continue_final_message: false,
        add_special_tokens: false,
        template_kwargs: Value::from(()),
    }
}

#[test]
fn renders_with_special_tokens_python_methods_and_generation_prompt() {
    let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}<{{ m.role.upper() }}>{{ m.content.strip() }}\n{% endfor %}{% if add_generation_prompt %}<A>{% endif %}".into(),
            vec![("bos_token".into(), "<s>".into())],
        )
        .unwrap();
    let out = t
        .render(&chat(
            serde_json::json!([{"role": "user", "content": " hi "}]),
        ))
        .unwrap();
    assert_eq!(out, "<s><USER>hi\n<A>");
}

#[test]
fn raise_exception_and_syntax_errors_are_reported() {
    let t = ChatTemplate::new(
        "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
            .into(),
        vec![],
    )
    .unwrap();
    let e = t
        .render(&chat(serde_json::json!([{"role": "user", "content": "x"}])))
        .unwrap_err();
    assert!(e.contains("system first"), "{e}");
    let e = ChatTemplate::new("{% if %}".into(), vec![]).unwrap_err();
    assert!(e.contains("does not compile"), "{e}");
}

#[test]
fn continue_final_message_cuts_after_the_last_content() {
    let t = ChatTemplate::new(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}[end]{% endfor %}".into(),
        vec![],
    )
    .unwrap();
    let mut c = chat(serde_json::json!([
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}
    ]));
    c.continue_final_message = true;
    assert_eq!(
        t.render(&c).unwrap(),
        "[user]q[end][assistant]The answer is"
    );
}
