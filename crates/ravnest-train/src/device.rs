//! Where a process computes: the CPU, or a CUDA GPU through candle's CUDA backend (the `cuda`
//! cargo feature).
//!
//! One process is one node, and a node computes on one device: it is chosen once, when the
//! process starts ([`select`]), from the node's `device` in the cluster file (`cpu`, `cuda`,
//! `cuda:1`, or a catalog GPU such as `rtx3090`, which means the first GPU) or from
//! `run --device`. Every tensor of the process's training is made there ([`current`]).

use std::sync::OnceLock;

use candle_core::Device;

/// A device as the user names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunDevice {
    /// The CPU.
    Cpu,
    /// CUDA device number N.
    Cuda(usize),
}

impl std::fmt::Display for RunDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunDevice::Cpu => write!(f, "cpu"),
            RunDevice::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// A device that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DeviceError {
    /// Not a device name.
    #[error("unknown device `{0}` (cpu, cuda, cuda:N, or a GPU of the catalog: `ravnest catalog`)")]
    Unknown(String),
    /// A CUDA device, and this binary has no CUDA backend.
    #[error(
        "device `{0}` is a CUDA GPU, and this ravnest was built without CUDA: build it with `source scripts/cuda-env.sh && cargo build --release --features cuda` (docs/gpu.md), or train on the CPU with `--device cpu`"
    )]
    NotBuilt(String),
    /// The CUDA backend could not open the device.
    #[error("cannot open `{device}`: {why}")]
    Open {
        /// The device.
        device: String,
        /// candle's (the driver's) reason.
        why: String,
    },
}

impl RunDevice {
    /// `cpu`, `cuda`, `cuda:N`, or a catalog device (`cpu`, or a GPU: the first CUDA device).
    pub fn parse(name: &str) -> Result<RunDevice, DeviceError> {
        let key = name.trim().to_ascii_lowercase();
        if key == "cpu" {
            return Ok(RunDevice::Cpu);
        }
        if key == "cuda" || key == "gpu" {
            return Ok(RunDevice::Cuda(0));
        }
        if let Some(n) = key.strip_prefix("cuda:") {
            return n
                .parse()
                .map(RunDevice::Cuda)
                .map_err(|_| DeviceError::Unknown(name.to_string()));
        }
        // A catalog card, GPU 0 or the one its `:N` names (`rtx3090:1`).
        let ordinal = ravnest_core::device::split_ordinal(name).1.unwrap_or(0) as usize;
        match ravnest_core::device::lookup(name) {
            Some(d) if d.id == "cpu" => Ok(RunDevice::Cpu),
            Some(_) => Ok(RunDevice::Cuda(ordinal)),
            None => Err(DeviceError::Unknown(name.to_string())),
        }
    }

    /// Whether this binary can use it (a CUDA device needs the `cuda` feature), without
    /// opening it.
    pub fn check(self) -> Result<RunDevice, DeviceError> {
        match self {
            RunDevice::Cuda(_) if !cfg!(feature = "cuda") => {
                Err(DeviceError::NotBuilt(self.to_string()))
            }
            d => Ok(d),
        }
    }

    /// Open it with candle.
    pub fn open(self) -> Result<Device, DeviceError> {
        match self {
            RunDevice::Cpu => Ok(Device::Cpu),
            RunDevice::Cuda(n) => {
                if !cfg!(feature = "cuda") {
                    return Err(DeviceError::NotBuilt(self.to_string()));
                }
                Device::new_cuda(n).map_err(|e| {
                    // candle's message carries a backtrace after its first line.
                    let first = e.to_string().lines().next().unwrap_or_default().to_string();
                    let hint = if first.contains("STUB_LIBRARY")
                        || first.contains("NO_DEVICE")
                        || first.contains("INSUFFICIENT_DRIVER")
                    {
                        " (no NVIDIA GPU, or no driver for CUDA 13, on this machine: `--device cpu` trains on the CPU)"
                    } else {
                        ""
                    };
                    DeviceError::Open {
                        device: self.to_string(),
                        why: format!("{first}{hint}"),
                    }
                })
            }
        }
    }
}

/// Where node `index` of `s` computes: `over` (`run --device`) if given, else its `device`.
pub fn of_node(
    s: &ravnest_core::Scenario,
    index: usize,
    over: Option<&str>,
) -> Result<RunDevice, DeviceError> {
    let raw = over
        .or_else(|| s.run.devices.get(index).map(String::as_str))
        .unwrap_or("cpu");
    RunDevice::parse(raw)
}

static CURRENT: OnceLock<Device> = OnceLock::new();

/// Compute on `device` from now on in this process (the first choice stays: one process is
/// one node on one device). Returns the device in use.
pub fn select(device: RunDevice) -> Result<Device, DeviceError> {
    if let Some(d) = CURRENT.get() {
        return Ok(d.clone());
    }
    let d = device.open()?;
    Ok(CURRENT.get_or_init(|| d).clone())
}

/// The device this process computes on (the CPU until [`select`] chose another).
pub fn current() -> Device {
    CURRENT.get().cloned().unwrap_or(Device::Cpu)
}

/// Whether this process computes on the CPU.
pub fn on_cpu() -> bool {
    matches!(current(), Device::Cpu)
}

/// Wait for the device's queued work (GPU kernels run asynchronously).
pub fn synchronize(d: &Device) {
    let _ = d.synchronize();
}

/// Free memory on `d` in bytes, where the device says (a CUDA GPU); `None` for the CPU.
pub fn free_memory(d: &Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(c) = d {
        return c
            .cuda_stream()
            .context()
            .mem_get_info()
            .ok()
            .map(|(free, _total)| free as u64);
    }
    let _ = d;
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_to_devices() {
        assert_eq!(RunDevice::parse("cpu"), Ok(RunDevice::Cpu));
        assert_eq!(RunDevice::parse("CUDA"), Ok(RunDevice::Cuda(0)));
        assert_eq!(RunDevice::parse("cuda:3"), Ok(RunDevice::Cuda(3)));
        assert_eq!(RunDevice::parse("rtx3090"), Ok(RunDevice::Cuda(0)));
        assert_eq!(RunDevice::parse("RTX 4090"), Ok(RunDevice::Cuda(0)));
        assert!(matches!(
            RunDevice::parse("cuda:x"),
            Err(DeviceError::Unknown(_))
        ));
        assert!(matches!(
            RunDevice::parse("tpu"),
            Err(DeviceError::Unknown(_))
        ));
    }

    #[test]
    #[cfg(not(feature = "cuda"))]
    fn a_cuda_device_without_the_feature_says_how_to_build() {
        let e = RunDevice::Cuda(0).open().unwrap_err().to_string();
        assert!(
            e.contains("--features cuda") && e.contains("cuda-env.sh"),
            "{e}"
        );
    }
}
