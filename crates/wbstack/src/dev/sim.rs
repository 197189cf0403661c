//! Simulated SSD and HDD (placeholder until the timing model lands).
use super::{Completer, Device, DeviceSpec, Geometry, SpecError};
use crate::block::bio::Request;
use crate::clock::ClockRef;
use std::any::Any;

pub struct SimDevice {
    spec: String,
    geo: Geometry,
}

impl SimDevice {
    pub fn from_spec(spec: &DeviceSpec, _clock: ClockRef) -> Result<SimDevice, SpecError> {
        Err(spec.err("sim devices are not built yet"))
    }
}

impl Device for SimDevice {
    fn geometry(&self) -> &Geometry {
        &self.geo
    }
    fn spec(&self) -> &str {
        &self.spec
    }
    fn queue_rq(&self, _rq: Request, _done: &Completer) {
        unimplemented!()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
