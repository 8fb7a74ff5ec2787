//! Model families, one module each: hyper-parameters, tensor binding, forward pass.

pub mod llama;
