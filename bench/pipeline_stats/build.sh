#!/bin/sh
# Builds the layer next to its manifest: ./build.sh (needs gcc and the Vulkan headers: apt-get install -y
# libvulkan-dev). `./build.sh fake` also builds the test double VK_LAYER_MAMBACTL_fake_driver (fake_driver_layer.c).
set -e
cd "$(dirname "$0")"
gcc -std=c99 -O2 -shared -fPIC -Wall -Wextra -o libVkLayer_mambactl_stats.so stats_layer.c
if [ "$1" = fake ]; then
    gcc -std=c99 -O2 -shared -fPIC -Wall -Wextra -o libVkLayer_mambactl_fake_driver.so fake_driver_layer.c
fi
