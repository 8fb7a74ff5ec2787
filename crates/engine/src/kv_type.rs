//! How a session stores its K and V rows (a leaf of the engine's modules: the
//! errors, the state variants, the families and the session all name it).

/// How K and V rows are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvType {
    /// f32: exactly what the projections computed.
    #[default]
    F32,
    /// IEEE binary16, rounded to nearest even when stored: half the memory, half the
    /// attention reads and half the checkpoint size.
    F16,
}

impl KvType {
    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
        }
    }

    /// Bytes per stored element.
    pub fn bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
        }
    }

    /// The payload's code for it.
    pub(crate) fn code(self) -> u32 {
        match self {
            KvType::F32 => 0,
            KvType::F16 => 1,
        }
    }

    pub(crate) fn from_code(c: u32) -> Option<Self> {
        match c {
            0 => Some(KvType::F32),
            1 => Some(KvType::F16),
            _ => None,
        }
    }
}

impl std::fmt::Display for KvType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(KvType::F32),
            "f16" => Ok(KvType::F16),
            _ => Err(format!("K/V type {s:?}: expected f32 or f16")),
        }
    }
}
