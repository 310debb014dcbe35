//! Kernel signatures, read from the kernels themselves and checked against the compiled image.
//!
//! The one source is a `.cu` file's `extern "C" __global__` declarations after the C
//! preprocessor has expanded its macros (build.rs runs it), so the variants a macro stamps out
//! are read like the kernels written by hand and nothing restates them.  A CUDA build then
//! checks that list against the `.entry` directives of every PTX image nvcc made for the file:
//! each declared kernel is exported, each export is declared, and every parameter has the size
//! and register class its kind passes (ptr, i64, u64: 8-byte integer; i32, u32: 4-byte
//! integer; f32, f64: 4- and 8-byte float; tmap: 128 bytes aligned to 64, a `CUtensorMap`).

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

/// The text after the parenthesised group `text` starts with, and the group's inside.
fn split_group(text: &str) -> Option<(&str, &str)> {
    let mut depth = 0;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return Some((&text[1..i], &text[i + 1..]));
                }
            }
            _ => {}
        }
    }
    None
}

/// The identifier `text` starts with and the text after it (trimmed).
fn leading_word(text: &str) -> (&str, &str) {
    let end = text.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(text.len());
    (&text[..end], text[end..].trim_start())
}

/// Skips `__launch_bounds__(...)`, `__cluster_dims__(...)` and other `__word__` qualifiers;
/// returns whether `__global__` was among them and the text after them.
fn skip_qualifiers(mut rest: &str) -> Result<(bool, &str), String> {
    let mut global = false;
    loop {
        let (word, after) = leading_word(rest);
        if !(word.starts_with("__") && word.len() > 2) {
            return Ok((global, rest));
        }
        global |= word == "__global__";
        rest = if after.starts_with('(') {
            let (_, after_group) = split_group(after).ok_or_else(|| format!("unclosed {word}(...)"))?;
            after_group.trim_start()
        } else {
            after
        };
    }
}

/// `rest` follows an `extern "C"`; a kernel declaration is `[qualifiers] void [qualifiers]
/// name(params)` with `__global__` among the qualifiers.  Anything else is not a kernel.
fn parse_declaration(rest: &str) -> Result<Option<KernelSignature>, String> {
    let (global_before, rest) = skip_qualifiers(rest.trim_start())?;
    let (word, rest) = leading_word(rest);
    if word != "void" {
        return if global_before {
            Err(format!("a __global__ kernel must return void, not '{word}'"))
        } else {
            Ok(None)
        };
    }
    let (global_after, rest) = skip_qualifiers(rest)?;
    if !(global_before || global_after) {
        return Ok(None);
    }
    let (name, rest) = leading_word(rest);
    if name.is_empty() || !rest.starts_with('(') {
        return Err(format!(
            "kernel declaration '{}' has no name and parameter list",
            rest.lines().next().unwrap_or("")
        ));
    }
    let (params, _) = split_group(rest).ok_or_else(|| format!("kernel {name}: unclosed parameter list"))?;
    let params = split_params(params)
        .iter()
        .filter(|p| p.as_str() != "void")
        .map(|p| kind_of_c_type(p).map_err(|e| format!("kernel {name}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(KernelSignature { name: name.to_string(), params }))
}

/// All kernels a preprocessed source declares, in source order; an error names the problem.
pub fn parse_signatures(source: &str) -> Result<Vec<KernelSignature>, String> {
    const EXTERN_C: &str = "extern \"C\"";
    let mut kernels = Vec::new();
    let mut search = 0;
    while let Some(found) = source[search..].find(EXTERN_C) {
        let start = search + found + EXTERN_C.len();
        if let Some(kernel) = parse_declaration(&source[start..])? {
            kernels.push(kernel);
        }
        search = start;
    }
    let mut names: Vec<&str> = kernels.iter().map(|k| k.name.as_str()).collect();
    names.sort_unstable();
    if let Some(pair) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!("kernel {} is declared twice", pair[0]));
    }
    Ok(kernels)
}

/// One `.param` of a PTX entry: its type (`u64`, `f32`, `b8`, ...), size and alignment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PtxParam {
    pub ty: String,
    pub bytes: usize,
    pub align: Option<usize>,
}

/// One `.entry` of a PTX image: a kernel the image exports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PtxEntry {
    pub name: String,
    pub params: Vec<PtxParam>,
}

fn ptx_type_bytes(ty: &str) -> Option<usize> {
    Some(match ty {
        "b8" | "u8" | "s8" => 1,
        "b16" | "u16" | "s16" | "f16" | "bf16" => 2,
        "b32" | "u32" | "s32" | "f32" => 4,
        "b64" | "u64" | "s64" | "f64" => 8,
        _ => return None,
    })
}

fn parse_ptx_param(entry: &str, text: &str) -> Result<PtxParam, String> {
    let words: Vec<&str> = text.split_whitespace().collect();
    if words.first() != Some(&".param") || words.len() < 3 {
        return Err(format!("entry {entry}: cannot read parameter '{text}'"));
    }
    let mut ty = None;
    let mut align = None;
    let mut i = 1;
    // `.param [.align N] .type [.ptr .space .align M] name[count]`: the first `.align` is the
    // parameter's own, one after the type belongs to what a pointer points at.
    while i + 1 < words.len() {
        let word = words[i].trim_start_matches('.');
        if words[i] == ".align" && ty.is_none() {
            align = Some(words[i + 1].parse().map_err(|_| format!("entry {entry}: bad alignment in '{text}'"))?);
            i += 1;
        } else if ty.is_none() && ptx_type_bytes(word).is_some() {
            ty = Some(word.to_string());
        }
        i += 1;
    }
    let ty = ty.ok_or_else(|| format!("entry {entry}: no type in parameter '{text}'"))?;
    let name = words[words.len() - 1];
    let count = match name.find('[') {
        Some(open) => name[open + 1..name.len() - 1]
            .parse::<usize>()
            .map_err(|_| format!("entry {entry}: bad array size in '{text}'"))?,
        None => 1,
    };
    let bytes = ptx_type_bytes(&ty).unwrap() * count;
    Ok(PtxParam { ty, bytes, align })
}

/// Every `.entry` of a PTX module with its parameters, in file order.
pub fn parse_ptx_entries(ptx: &str) -> Result<Vec<PtxEntry>, String> {
    const ENTRY: &str = ".entry ";
    let mut entries = Vec::new();
    let mut search = 0;
    while let Some(found) = ptx[search..].find(ENTRY) {
        let start = search + found + ENTRY.len();
        search = start;
        let line_start = ptx[..start].rfind('\n').map_or(0, |i| i + 1);
        if ptx[line_start..start].trim_start().starts_with("//") {
            continue;
        }
        let rest = &ptx[start..];
        let open = rest
            .find('(')
            .ok_or_else(|| format!("PTX entry without a parameter list: {}", &rest[..40.min(rest.len())]))?;
        let name = rest[..open].trim().to_string();
        let close = rest[open..].find(')').ok_or_else(|| format!("entry {name}: unclosed parameter list"))? + open;
        let params = rest[open + 1..close]
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| parse_ptx_param(&name, p))
            .collect::<Result<Vec<_>, _>>()?;
        entries.push(PtxEntry { name, params });
    }
    Ok(entries)
}

/// What a parameter of `kind` must be in PTX: register class, bytes and alignment (if any).
fn expected_ptx(kind: &str) -> (&'static str, usize, Option<usize>) {
    match kind {
        "ptr" | "i64" | "u64" => ("integer", 8, None),
        "i32" | "u32" => ("integer", 4, None),
        "f32" => ("float", 4, None),
        "f64" => ("float", 8, None),
        "tmap" => ("bytes", 128, Some(64)),
        other => unreachable!("unknown parameter kind {other}"),
    }
}

fn ptx_class(param: &PtxParam) -> &'static str {
    if param.ty.starts_with('f') {
        "float"
    } else if param.bytes != ptx_type_bytes(&param.ty).unwrap_or(0) {
        "bytes" // an array: a struct passed by value
    } else {
        "integer"
    }
}

fn describe(param: &PtxParam) -> String {
    let align = param.align.map(|a| format!(".align {a} ")).unwrap_or_default();
    let element = ptx_type_bytes(&param.ty).unwrap_or(1);
    if param.bytes == element {
        format!("{align}.{}", param.ty)
    } else {
        format!("{align}.{}[{}]", param.ty, param.bytes / element)
    }
}

/// Differences between the declared kernels and the image's entries, one message each; empty
/// when they agree.  Entries the image has twice (it cannot) are not looked for.
pub fn check_image(declared: &[KernelSignature], exported: &[PtxEntry]) -> Vec<String> {
    let mut problems = Vec::new();
    for kernel in declared {
        let Some(entry) = exported.iter().find(|e| e.name == kernel.name) else {
            problems.push(format!("kernel '{}' is declared but the image does not export it", kernel.name));
            continue;
        };
        if entry.params.len() != kernel.params.len() {
            problems.push(format!(
                "kernel '{}' is declared with {} parameters ({}) but the image's entry has {}",
                kernel.name,
                kernel.params.len(),
                kernel.params.join(", "),
                entry.params.len()
            ));
            continue;
        }
        for (index, (kind, param)) in kernel.params.iter().zip(&entry.params).enumerate() {
            let (class, bytes, align) = expected_ptx(kind);
            let align_ok = align.is_none() || param.align == align;
            if ptx_class(param) != class || param.bytes != bytes || !align_ok {
                problems.push(format!(
                    "kernel '{}' parameter {index} is {kind} in the source but {} in the image",
                    kernel.name,
                    describe(param)
                ));
            }
        }
    }
    for entry in exported {
        if !declared.iter().any(|k| k.name == entry.name) {
            problems.push(format!(
                "the image exports '{}', which no extern \"C\" __global__ declaration names",
                entry.name
            ));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig(name: &str, params: &[&'static str]) -> KernelSignature {
        KernelSignature { name: name.to_string(), params: params.to_vec() }
    }

    #[test]
    fn reads_declarations() {
        let src = r#"
            extern "C" __global__ void __launch_bounds__(256) scale(float* __restrict__ out,
                const __half* in, int64_t n, float alpha, unsigned int flags,
                const __grid_constant__ batchinv::TensorMap map) { }
            extern "C" __global__ void nothing(void) {}
            extern "C" __cluster_dims__(8, 1, 1) __global__ void __launch_bounds__(64, 2) clustered(
                batchinv::F32Codec::storage* out, const batchinv::Bf16Codec::storage* x, int32_t n) {}
        "#;
        let kernels = parse_signatures(src).unwrap();
        assert_eq!(kernels[0], sig("scale", &["ptr", "ptr", "i64", "f32", "u32", "tmap"]));
        assert_eq!(kernels[1], sig("nothing", &[]));
        assert_eq!(kernels[2], sig("clustered", &["ptr", "ptr", "i32"]));
    }

    #[test]
    fn reads_what_a_macro_expanded_to() {
        // The preprocessor's output: several kernels on one line, bodies included.
        let src = "extern \"C\" __global__ void __launch_bounds__(128) k_a( float* x, int64_t n) { f<1>(x, n); } \
                   extern \"C\" __global__ void __launch_bounds__(128) k_b( float* x, int64_t n) { f<2>(x, n); }";
        let kernels = parse_signatures(src).unwrap();
        assert_eq!(kernels, vec![sig("k_a", &["ptr", "i64"]), sig("k_b", &["ptr", "i64"])]);
    }

    #[test]
    fn skips_what_is_not_a_kernel() {
        let src = "extern \"C\" __device__ float helper(float x);\nextern \"C\" void host_only(int x);\n\
                   extern \"C\" { int table[4]; }\n";
        assert_eq!(parse_signatures(src).unwrap(), vec![]);
    }

    #[test]
    fn rejects_unpassable_types_and_duplicates() {
        let err = parse_signatures("extern \"C\" __global__ void k(Foo x) {}").unwrap_err();
        assert!(err.contains("type 'Foo'"), "{err}");
        let err =
            parse_signatures("extern \"C\" __global__ void k(int* x);\nextern \"C\" __global__ void k(int* x) {}")
                .unwrap_err();
        assert!(err.contains("declared twice"), "{err}");
        let err = parse_signatures("extern \"C\" __global__ int k(int* x) {}").unwrap_err();
        assert!(err.contains("must return void"), "{err}");
    }

    const PTX: &str = "
//
// Generated by NVIDIA NVVM Compiler
// .visible .entry commented_out(
.version 9.0
.target sm_80
.address_size 64

.visible .entry scale(
\t.param .u64 scale_param_0,
\t.param .u64 .ptr .global .align 16 scale_param_1,
\t.param .u64 scale_param_2,
\t.param .f32 scale_param_3,
\t.param .u32 scale_param_4,
\t.param .align 64 .b8 scale_param_5[128]
)
.maxntid 256, 1, 1
{
\tret;
}
.visible .entry nothing()
{
\tret;
}
";

    #[test]
    fn reads_ptx_entries() {
        let entries = parse_ptx_entries(PTX).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].name, "scale");
        let sizes: Vec<usize> = entries[0].params.iter().map(|p| p.bytes).collect();
        assert_eq!(sizes, vec![8, 8, 8, 4, 4, 128]);
        assert_eq!(entries[0].params[1].align, None); // the pointee's alignment, not the parameter's
        assert_eq!(entries[0].params[5], PtxParam { ty: "b8".into(), bytes: 128, align: Some(64) });
        assert_eq!(entries[1], PtxEntry { name: "nothing".into(), params: vec![] });
    }

    #[test]
    fn a_matching_image_passes() {
        let entries = parse_ptx_entries(PTX).unwrap();
        let declared = vec![sig("scale", &["ptr", "ptr", "i64", "f32", "u32", "tmap"]), sig("nothing", &[])];
        assert_eq!(check_image(&declared, &entries), Vec::<String>::new());
    }

    #[test]
    fn catches_every_mismatch() {
        let entries = parse_ptx_entries(PTX).unwrap();
        // i32 where the image has 8 bytes, f32 where it has an integer, u64 where it has a
        // tensor map; a kernel the image lacks; an export nothing declares.
        let declared = vec![sig("scale", &["ptr", "ptr", "i32", "f32", "f32", "u64"]), sig("gone", &["ptr"])];
        let problems = check_image(&declared, &entries);
        assert_eq!(
            problems,
            vec![
                "kernel 'scale' parameter 2 is i32 in the source but .u64 in the image",
                "kernel 'scale' parameter 4 is f32 in the source but .u32 in the image",
                "kernel 'scale' parameter 5 is u64 in the source but .align 64 .b8[128] in the image",
                "kernel 'gone' is declared but the image does not export it",
                "the image exports 'nothing', which no extern \"C\" __global__ declaration names",
            ]
        );
        let short = vec![sig("scale", &["ptr"]), sig("nothing", &[])];
        assert_eq!(
            check_image(&short, &entries),
            vec!["kernel 'scale' is declared with 1 parameters (ptr) but the image's entry has 6"]
        );
    }
}
