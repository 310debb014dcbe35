//! Reads kernel signatures out of `.cu` sources, so the launcher's argument checks come
//! from the kernels themselves and cannot drift from them.
//!
//! Two forms are recognised:
//! - a plain declaration `extern "C" __global__ void name(const float* x, int64_t n)`;
//! - a comment `// batchinv-signature: name(ptr, i64)` for kernels a macro instantiates
//!   (macro bodies, whose names contain `##`, are skipped).

/// One kernel: its name and its parameter kinds as the launcher spells them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelSignature {
    pub name: String,
    pub params: Vec<&'static str>,
}

fn kind_of_c_type(param: &str) -> Result<&'static str, String> {
    if param.contains('*') {
        return Ok("ptr");
    }
    if param.contains("TensorMap") {
        return Ok("tmap"); // a __grid_constant__ TMA descriptor passed by value
    }
    let words: Vec<&str> = param
        .split_whitespace()
        .filter(|w| !matches!(*w, "const" | "volatile" | "__restrict__" | "__grid_constant__"))
        .collect();
    // The last word is the parameter's name; the rest is its type.
    let type_words = if words.len() > 1 { &words[..words.len() - 1] } else { &words[..] };
    let kind = match type_words.join(" ").as_str() {
        "int64_t" | "long long" | "long long int" | "ptrdiff_t" => "i64",
        "uint64_t" | "unsigned long long" | "size_t" => "u64",
        "int32_t" | "int" => "i32",
        "uint32_t" | "unsigned" | "unsigned int" => "u32",
        "float" => "f32",
        "double" => "f64",
        other => return Err(format!("parameter '{param}' has type '{other}', which the launcher cannot pass")),
    };
    Ok(kind)
}

fn split_params(text: &str) -> Vec<String> {
    let mut params = Vec::new();
    let mut depth = 0i32;
    let mut current = String::new();
    for c in text.chars() {
        match c {
            '(' | '<' => depth += 1,
            ')' | '>' => depth -= 1,
            ',' if depth == 0 => {
                params.push(current.trim().to_string());
                current.clear();
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    if !current.trim().is_empty() {
        params.push(current.trim().to_string());
    }
    params
}

fn parse_declaration(rest: &str) -> Result<Option<KernelSignature>, String> {
    // rest starts after `__global__`; expect `void [__launch_bounds__(..)] name(params)`.
    let rest = rest.trim_start();
    let rest = rest.strip_prefix("void").ok_or("a __global__ kernel must return void")?.trim_start();
    let rest = if let Some(after) = rest.strip_prefix("__launch_bounds__") {
        let close = after.find(')').ok_or("unclosed __launch_bounds__")?;
        after[close + 1..].trim_start()
    } else {
        rest
    };
    let open = rest.find('(').ok_or("kernel declaration without parameter list")?;
    let name = rest[..open].trim();
    if name.contains("##") {
        return Ok(None); // a macro body; its instances carry signature comments
    }
    let mut depth = 0;
    let mut close = None;
    for (i, c) in rest[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    close = Some(open + i);
                    break;
                }
            }
            _ => {}
        }
    }
    let close = close.ok_or_else(|| format!("kernel {name}: unclosed parameter list"))?;
    let params = split_params(&rest[open + 1..close])
        .iter()
        .filter(|p| p.as_str() != "void")
        .map(|p| kind_of_c_type(p).map_err(|e| format!("kernel {name}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(KernelSignature { name: name.to_string(), params }))
}

fn parse_comment(text: &str) -> Result<KernelSignature, String> {
    let open = text.find('(').ok_or_else(|| format!("signature comment '{text}' has no '('"))?;
    let close = text.rfind(')').ok_or_else(|| format!("signature comment '{text}' has no ')'"))?;
    let name = text[..open].trim().to_string();
    let mut params = Vec::new();
    for word in text[open + 1..close].split(',').map(str::trim).filter(|w| !w.is_empty()) {
        let kind = match word {
            "ptr" => "ptr",
            "i32" => "i32",
            "u32" => "u32",
            "i64" => "i64",
            "u64" => "u64",
            "f32" => "f32",
            "f64" => "f64",
            "tmap" => "tmap",
            other => return Err(format!("signature comment for {name}: unknown type '{other}'")),
        };
        params.push(kind);
    }
    Ok(KernelSignature { name, params })
}

/// All kernels a source declares, in source order; an error names the problem.
pub fn parse_signatures(source: &str) -> Result<Vec<KernelSignature>, String> {
    const DECLARATION: &str = "extern \"C\" __global__";
    const COMMENT: &str = "// batchinv-signature:";
    let mut kernels = Vec::new();
    let mut search = 0;
    while let Some(found) = source[search..].find(DECLARATION) {
        let start = search + found + DECLARATION.len();
        if let Some(kernel) = parse_declaration(&source[start..])? {
            kernels.push(kernel);
        }
        search = start;
    }
    for line in source.lines() {
        if let Some(text) = line.trim().strip_prefix(COMMENT) {
            kernels.push(parse_comment(text)?);
        }
    }
    let mut names: Vec<&str> = kernels.iter().map(|k| k.name.as_str()).collect();
    names.sort_unstable();
    if let Some(pair) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!("kernel {} is declared twice", pair[0]));
    }
    Ok(kernels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_plain_declarations() {
        let src = r#"
            extern "C" __global__ void __launch_bounds__(256) scale(float* __restrict__ out,
                const __half* in, int64_t n, float alpha, unsigned int flags,
                const __grid_constant__ batchinv::TensorMap map) { }
            extern "C" __global__ void nothing(void) {}
        "#;
        let kernels = parse_signatures(src).unwrap();
        assert_eq!(kernels[0].name, "scale");
        assert_eq!(kernels[0].params, vec!["ptr", "ptr", "i64", "f32", "u32", "tmap"]);
        assert_eq!(kernels[1], KernelSignature { name: "nothing".into(), params: vec![] });
    }

    #[test]
    fn reads_comments_and_skips_macro_bodies() {
        let src = "#define K(S) extern \"C\" __global__ void k_##S(float* x) {}\n\
                   // batchinv-signature: k_a(ptr, i32)\nK(a)\n";
        let kernels = parse_signatures(src).unwrap();
        assert_eq!(kernels, vec![KernelSignature { name: "k_a".into(), params: vec!["ptr", "i32"] }]);
    }

    #[test]
    fn rejects_unpassable_types_and_duplicates() {
        let err = parse_signatures("extern \"C\" __global__ void k(Foo x) {}").unwrap_err();
        assert!(err.contains("type 'Foo'"), "{err}");
        let err = parse_signatures("// batchinv-signature: k(ptr)\n// batchinv-signature: k(ptr)").unwrap_err();
        assert!(err.contains("declared twice"), "{err}");
        let err = parse_signatures("// batchinv-signature: k(pointer)").unwrap_err();
        assert!(err.contains("unknown type 'pointer'"), "{err}");
    }
}
