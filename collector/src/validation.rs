//! The built-in validation check, run as `perch __validate-gpus` by the agent when the server
//! asks for its default validation command (`[validation] command` unset). It proves the
//! node's GPUs healthy before the node takes work again:
//!
//! 1. through NVML (the driver's, or the stand-in's in tests): every GPU the agent found is
//!    there and answers, none has uncorrected volatile ECC errors or pages pending
//!    retirement, its memory can be read, and no XID or double-bit ECC event arrives while
//!    the check runs;
//! 2. when CUDA is present (a real driver, not the stand-in) and `python3` can import torch:
//!    a GPU burn (matrix multiplications on every GPU for `--burn-secs`, each result compared
//!    with the first and with a float64 reference) and a memory check (a pattern written over
//!    a share of each GPU's free memory and read back). Without torch the burn is skipped,
//!    and the output says so.
//!
//! Simulated GPUs have nothing to check; the output says so (labelled simulated). The check
//! prints one line per GPU, then `validation passed` or, last, the failure the node's drain
//! reason quotes, and exits 0 only when all pass.

use crate::gpu::NvmlMode;
use std::path::PathBuf;
use std::process::Command;

/// The subcommand of the `perch` binary that runs [`run`].
pub const SUBCOMMAND: &str = "__validate-gpus";

/// What the server sends for the built-in check: the agent replaces `perch` with its own
/// program and adds what it knows of the node ([`Builtin::argv`]).
pub const SERVER_ARGV: [&str; 2] = ["perch", SUBCOMMAND];

/// The GPU burn and memory check, run with `python3 -c` when torch can see CUDA.
pub const BURN_SCRIPT: &str = include_str!("validation/burn.py");

/// What the agent knows that the check needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Builtin {
    /// The `perch` binary (the agent's own).
    pub program: PathBuf,
    pub nvml: NvmlMode,
    /// GPUs the agent reports, simulated ones included.
    pub gpus: u32,
    pub simulated_gpus: u32,
}

impl Builtin {
    /// The command line for a server's `argv`: the built-in check with this node's facts
    /// (and the server's extra arguments, `--burn-secs N`) when `argv` asks for it, else
    /// `argv` unchanged.
    pub fn argv(&self, argv: Vec<String>) -> Vec<String> {
        if argv.len() < 2 || argv[0] != SERVER_ARGV[0] || argv[1] != SERVER_ARGV[1] {
            return argv;
        }
        let nvml = match &self.nvml {
            NvmlMode::Auto => "auto".to_owned(),
            NvmlMode::Off => "off".to_owned(),
            NvmlMode::Path(p) => p.display().to_string(),
        };
        let mut out = vec![
            self.program.display().to_string(),
            SUBCOMMAND.to_owned(),
            "--nvml".into(),
            nvml,
            "--gpus".into(),
            self.gpus.to_string(),
            "--simulated-gpus".into(),
            self.simulated_gpus.to_string(),
        ];
        out.extend(argv.into_iter().skip(2));
        out
    }
}

/// The check's options, from its command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub nvml: NvmlMode,
    pub gpus: u32,
    pub simulated_gpus: u32,
    pub burn_secs: u32,
}

impl Options {
    /// Parses `--nvml auto|off|PATH --gpus N --simulated-gpus N --burn-secs N`.
    pub fn parse(args: &[String]) -> Result<Options, String> {
        let mut o = Options {
            nvml: NvmlMode::Auto,
            gpus: 0,
            simulated_gpus: 0,
            burn_secs: 10,
        };
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let number = || {
                value
                    .parse::<u32>()
                    .map_err(|_| format!("{flag} takes a whole number, not {value:?}"))
            };
            match flag.as_str() {
                "--nvml" => {
                    o.nvml = match value.as_str() {
                        "auto" => NvmlMode::Auto,
                        "off" => NvmlMode::Off,
                        path => NvmlMode::Path(PathBuf::from(path)),
                    }
                }
                "--gpus" => o.gpus = number()?,
                "--simulated-gpus" => o.simulated_gpus = number()?,
                "--burn-secs" => o.burn_secs = number()?,
                other => {
                    return Err(format!(
                        "unknown option {other}; the check takes --nvml, --gpus, --simulated-gpus and --burn-secs"
                    ));
                }
            }
        }
        Ok(o)
    }
}

/// Runs the check, printing as it goes; true when every GPU passed.
pub fn run(o: &Options) -> bool {
    let mut ok = true;
    let mut say = |line: String| println!("{line}");
    if o.simulated_gpus > 0 {
        say(format!(
            "{} simulated GPU{}: nothing to check (simulated)",
            o.simulated_gpus,
            if o.simulated_gpus == 1 { "" } else { "s" }
        ));
    }
    let physical = o.gpus.saturating_sub(o.simulated_gpus);
    let cuda = match nvml_health(&o.nvml, physical, &mut say) {
        Ok(cuda) => cuda,
        Err(e) => {
            say(e);
            ok = false;
            false
        }
    };
    if ok && cuda {
        ok = burn(o.burn_secs, &mut say);
    }
    // A failure's own line is the last: it is what the node's drain reason quotes.
    if ok {
        say("validation passed".to_owned());
    }
    ok
}

/// NVML's health of each GPU. Ok(true) when the GPUs are a real driver's (CUDA present),
/// Ok(false) when there are none to check or they are the stand-in's.
fn nvml_health(
    mode: &NvmlMode,
    expected: u32,
    say: &mut impl FnMut(String),
) -> Result<bool, String> {
    use nvml_wrapper::Nvml;
    use nvml_wrapper::bitmasks::event::EventTypes;
    use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
    use nvml_wrapper::error::NvmlError;
    let nvml = match mode {
        NvmlMode::Off if expected == 0 => return Ok(false),
        NvmlMode::Off => {
            return Err(format!(
                "NVML is off but the node reports {expected} GPUs that are not simulated"
            ));
        }
        NvmlMode::Auto => Nvml::init(),
        NvmlMode::Path(p) => Nvml::builder().lib_path(p.as_os_str()).init(),
    };
    let nvml = match nvml {
        Ok(n) => n,
        Err(_) if expected == 0 && *mode == NvmlMode::Auto => {
            say("no NVIDIA driver here: no GPU to check".into());
            return Ok(false);
        }
        Err(e) => return Err(format!("NVML cannot be loaded: {e}")),
    };
    let driver = nvml.sys_driver_version().unwrap_or_default();
    let standin = driver.ends_with("-standin");
    let count = nvml
        .device_count()
        .map_err(|e| format!("NVML cannot count the GPUs: {e}"))?;
    let mut failed = Vec::new();
    if count < expected {
        failed.push(format!(
            "NVML lists {count} GPUs, the agent found {expected}: {} missing",
            expected - count
        ));
    }
    let mut events = nvml.create_event_set().ok();
    for index in 0..count {
        let device = match nvml.device_by_index(index) {
            Ok(d) => d,
            Err(e) => {
                failed.push(format!("GPU {index}: lost ({e})"));
                continue;
            }
        };
        let name = device.name().unwrap_or_else(|_| "unknown model".into());
        let mut problems = Vec::new();
        match device.memory_info() {
            Ok(m) if m.total > 0 => {}
            Ok(_) => problems.push("reports no memory".to_owned()),
            Err(e) => problems.push(format!("memory cannot be read ({e})")),
        }
        if let Ok(n) = device.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            && n > 0
        {
            problems.push(format!(
                "{n} uncorrected ECC errors since the driver loaded"
            ));
        }
        if matches!(device.are_pages_pending_retired(), Ok(true)) {
            problems.push("memory pages pending retirement (reset the GPU)".into());
        }
        let wanted = EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR;
        events = events.and_then(|set| device.register_events(wanted, set).ok());
        if problems.is_empty() {
            say(format!("GPU {index} ({name}): healthy"));
        } else {
            failed.push(format!("GPU {index} ({name}): {}", problems.join("; ")));
        }
    }
    if let Some(set) = &events {
        // Events raised while the check ran (the stand-in's are due by its clock).
        for _ in 0..count.max(1) * 4 {
            match set.wait(50) {
                Ok(e) => {
                    let gpu = e.device.index().map_or("?".to_owned(), |i| i.to_string());
                    failed.push(format!(
                        "GPU {gpu}: {:?} event during the check",
                        e.event_type
                    ));
                }
                Err(NvmlError::Timeout) => break,
                Err(_) => break,
            }
        }
    }
    if !failed.is_empty() {
        for f in &failed[..failed.len() - 1] {
            say(f.clone());
        }
        return Err(failed.last().cloned().unwrap_or_default());
    }
    if standin && count > 0 {
        say(format!(
            "{count} GPU{} of the stand-in NVML (driver {driver}): health only, no CUDA to burn",
            if count == 1 { "" } else { "s" }
        ));
    }
    Ok(!standin && count > 0)
}

/// The GPU burn and memory check through torch; skipped (passing) when torch cannot be
/// imported or sees no CUDA device.
fn burn(secs: u32, say: &mut impl FnMut(String)) -> bool {
    let probe = Command::new("python3")
        .args([
            "-c",
            "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)",
        ])
        .output();
    match probe {
        Ok(out) if out.status.success() => {}
        Ok(_) | Err(_) => {
            say("GPU burn skipped: python3 cannot import torch with CUDA here (install torch to burn)".into());
            return true;
        }
    }
    let out = Command::new("python3")
        .args(["-c", BURN_SCRIPT, &secs.to_string(), "cuda"])
        .output();
    match out {
        Ok(out) => {
            for line in String::from_utf8_lossy(&out.stdout)
                .lines()
                .chain(String::from_utf8_lossy(&out.stderr).lines())
            {
                say(line.to_owned());
            }
            out.status.success()
        }
        Err(e) => {
            say(format!("GPU burn could not start python3: {e}"));
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_fills_in_the_builtin_and_leaves_other_commands_alone() {
        let b = Builtin {
            program: PathBuf::from("/usr/bin/perch"),
            nvml: NvmlMode::Off,
            gpus: 4,
            simulated_gpus: 4,
        };
        let argv = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            b.argv(argv(&["perch", SUBCOMMAND, "--burn-secs", "5"])),
            argv(&[
                "/usr/bin/perch",
                SUBCOMMAND,
                "--nvml",
                "off",
                "--gpus",
                "4",
                "--simulated-gpus",
                "4",
                "--burn-secs",
                "5"
            ])
        );
        assert_eq!(b.argv(argv(&["/opt/check.sh"])), argv(&["/opt/check.sh"]));
        let o = Options::parse(&b.argv(argv(&["perch", SUBCOMMAND]))[2..]).expect("parses");
        assert_eq!((o.gpus, o.simulated_gpus, o.burn_secs), (4, 4, 10));
        assert!(run(&o), "simulated GPUs pass");
        assert!(
            Options::parse(&argv(&["--gpus", "x"]))
                .expect_err("bad")
                .contains("whole number")
        );
    }
}
