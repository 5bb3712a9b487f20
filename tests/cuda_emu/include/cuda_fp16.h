// Emulator stub (tests/cuda_emu): never the real CUDA header.
#pragma once
#include "../cuda_emu.hpp"
