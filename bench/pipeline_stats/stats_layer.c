/*
 * VK_LAYER_MAMBACTL_pipeline_stats: a Vulkan layer that reports what the driver made of every compute pipeline.
 *
 * For each compute pipeline the application creates (wgpu-native, unmodified) it asks the driver for the
 * pipeline's executables and their compile-time statistics (VK_KHR_pipeline_executable_properties: on most
 * drivers register counts, spills, shared memory, instruction counts) and appends one JSON line per executable
 * to the file named by MAMBACTL_PIPELINE_STATS (stderr when unset):
 *
 *   {"seq": 3, "pid": 123, "entry": "matmul", "executable": "...", "description": "...", "subgroup_size": 32,
 *    "stats": {"<driver's stat name>": value, ...}, "stat_descriptions": {"<name>": "...", ...}}
 *
 * seq counts the pipelines this process created (all its lines of one pipeline share it). With
 * MAMBACTL_PIPELINE_IR_DIR set it also asks for the driver's internal representations (NIR, LLVM IR, machine
 * code: whatever it offers) and writes each text one to DIR/<seq>_<entry>_<executable>_<representation>.txt.
 *
 * With MAMBACTL_PIPELINE_CACHE_DIR set it also gives each vkCreateComputePipelines call where the app passes no
 * pipeline cache (wgpu passes none) an empty cache of its own and writes what the driver put in it to
 * DIR/<seq>_<entry>.pipeline_cache.bin: the driver's binaries in a format of its own, which works on drivers
 * without the extension too (NVIDIA's, maybe: look in them for an ELF, `grep -obUaP '\x7fELF'`).
 *
 * What it changes: vkCreateDevice enables the extension and its pipelineExecutableInfo feature when the device
 * offers them and the app did not; vkCreateComputePipelines adds VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR
 * (and the internal representations bit when the IR dir is set; with the cache dir set, its own pipeline cache).
 * Everything else passes through. A device without the extension gets one line on stderr and no statistics.
 *
 * Enable it (an explicit layer: the loader reads these when the process starts):
 *   VK_LAYER_PATH=<this folder> VK_INSTANCE_LAYERS=VK_LAYER_MAMBACTL_pipeline_stats \
 *   MAMBACTL_PIPELINE_STATS=/tmp/stats.jsonl python bench/gemm.py ...
 * Build: ./build.sh (gcc, the Vulkan headers: apt-get install -y libvulkan-dev). The .so needs only libc.
 */

#define _POSIX_C_SOURCE 200809L /* strnlen, mkdir, getpid */

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <vulkan/vk_layer.h>
#include <vulkan/vulkan.h>

#define LAYER_NAME "VK_LAYER_MAMBACTL_pipeline_stats"
#define EXPORT __attribute__((visibility("default")))

/* ---------------------------------------------------------------------------------------------------------------
 * What the layer remembers per instance and per device, keyed by the dispatch key (the loader's dispatch table
 * pointer at the start of every dispatchable handle; a physical device shares its instance's).
 */

typedef void *DispatchKey;

static DispatchKey dispatch_key(const void *handle) { return *(DispatchKey *)handle; }

typedef struct InstanceRecord {
    struct InstanceRecord *next;
    DispatchKey key;
    VkInstance instance;
    int has_features2; /* Vulkan 1.1+ or VK_KHR_get_physical_device_properties2: the extension's prerequisite */
    PFN_vkGetInstanceProcAddr next_get_instance_proc_addr;
    PFN_vkDestroyInstance next_destroy_instance;
    PFN_vkEnumerateDeviceExtensionProperties next_enumerate_device_extensions;
    PFN_vkGetPhysicalDeviceProperties next_get_physical_device_properties;
    PFN_vkGetPhysicalDeviceFeatures2 next_get_physical_device_features2;
} InstanceRecord;

typedef struct DeviceRecord {
    struct DeviceRecord *next;
    DispatchKey key;
    VkDevice device;
    char device_name[VK_MAX_PHYSICAL_DEVICE_NAME_SIZE];
    PFN_vkGetDeviceProcAddr next_get_device_proc_addr;
    PFN_vkDestroyDevice next_destroy_device;
    PFN_vkCreateComputePipelines next_create_compute_pipelines;
    PFN_vkCreatePipelineCache create_pipeline_cache; /* MAMBACTL_PIPELINE_CACHE_DIR's dumps */
    PFN_vkGetPipelineCacheData get_pipeline_cache_data;
    PFN_vkDestroyPipelineCache destroy_pipeline_cache;
    /* NULL when the device does not offer VK_KHR_pipeline_executable_properties: then nothing is reported */
    PFN_vkGetPipelineExecutablePropertiesKHR get_executable_properties;
    PFN_vkGetPipelineExecutableStatisticsKHR get_executable_statistics;
    PFN_vkGetPipelineExecutableInternalRepresentationsKHR get_internal_representations;
} DeviceRecord;

static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;  /* the two lists and the pipeline counter */
static pthread_mutex_t output_lock = PTHREAD_MUTEX_INITIALIZER; /* the stats file and the IR files */
static InstanceRecord *instances;
static DeviceRecord *devices;
static unsigned long long pipeline_seq;

static InstanceRecord *find_instance_locked(DispatchKey key) {
    for (InstanceRecord *r = instances; r; r = r->next)
        if (r->key == key) return r;
    return NULL;
}

static DeviceRecord *find_device_locked(DispatchKey key) {
    for (DeviceRecord *r = devices; r; r = r->next)
        if (r->key == key) return r;
    return NULL;
}

/* Copies of the records (their function pointers stay valid while the app uses the handle). */
static int lookup_instance(DispatchKey key, InstanceRecord *out) {
    pthread_mutex_lock(&table_lock);
    InstanceRecord *r = find_instance_locked(key);
    if (r) *out = *r;
    pthread_mutex_unlock(&table_lock);
    return r != NULL;
}

static int lookup_device(DispatchKey key, DeviceRecord *out) {
    pthread_mutex_lock(&table_lock);
    DeviceRecord *r = find_device_locked(key);
    if (r) *out = *r;
    pthread_mutex_unlock(&table_lock);
    return r != NULL;
}

static void layer_message(const char *format, ...) {
    va_list args;
    va_start(args, format);
    fprintf(stderr, "%s: ", LAYER_NAME);
    vfprintf(stderr, format, args);
    fputc('\n', stderr);
    va_end(args);
}

/* ---------------------------------------------------------------------------------------------------------------
 * A growable string for one report, with JSON string escaping.
 */

typedef struct {
    char *data;
    size_t length, capacity;
} Text;

static void text_append(Text *t, const char *s, size_t n) {
    if (t->length + n + 1 > t->capacity) {
        size_t capacity = t->capacity ? t->capacity : 1024;
        while (t->length + n + 1 > capacity) capacity *= 2;
        char *grown = realloc(t->data, capacity);
        if (!grown) return; /* out of memory: the report is cut short, the app goes on */
        t->data = grown;
        t->capacity = capacity;
    }
    memcpy(t->data + t->length, s, n);
    t->length += n;
    t->data[t->length] = '\0';
}

static void text_printf(Text *t, const char *format, ...) {
    char buffer[512];
    va_list args;
    va_start(args, format);
    int n = vsnprintf(buffer, sizeof buffer, format, args);
    va_end(args);
    if (n > 0) text_append(t, buffer, (size_t)n < sizeof buffer ? (size_t)n : sizeof buffer - 1);
}

/* A JSON string of at most max_length bytes of s (driver strings are fixed arrays, maybe unterminated). */
static void text_json_string(Text *t, const char *s, size_t max_length) {
    text_append(t, "\"", 1);
    for (size_t i = 0; i < max_length && s[i]; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            char escaped[2] = {'\\', (char)c};
            text_append(t, escaped, 2);
        } else if (c == '\n') {
            text_append(t, "\\n", 2);
        } else if (c == '\t') {
            text_append(t, "\\t", 2);
        } else if (c < 0x20 || c == 0x7f) {
            text_printf(t, "\\u%04x", c);
        } else {
            text_append(t, (const char *)&c, 1); /* UTF-8 bytes pass as they are */
        }
    }
    text_append(t, "\"", 1);
}

static void text_statistic_value(Text *t, const VkPipelineExecutableStatisticKHR *stat) {
    switch (stat->format) {
    case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_BOOL32_KHR:
        text_printf(t, "%s", stat->value.b32 ? "true" : "false");
        break;
    case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_INT64_KHR:
        text_printf(t, "%lld", (long long)stat->value.i64);
        break;
    case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR:
        text_printf(t, "%llu", (unsigned long long)stat->value.u64);
        break;
    case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_FLOAT64_KHR:
        if (isfinite(stat->value.f64))
            text_printf(t, "%.17g", stat->value.f64);
        else
            text_printf(t, "null"); /* JSON has no NaN or infinity */
        break;
    default:
        text_printf(t, "null");
    }
}

/* Letters, digits, '.', '-' and '_' kept, anything else '_': a piece of a file name. */
static void sanitise(char *out, size_t out_size, const char *name, size_t max_length) {
    size_t n = 0;
    for (size_t i = 0; i < max_length && name[i] && n + 1 < out_size; i++) {
        char c = name[i];
        int keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                   c == '-' || c == '_';
        out[n++] = keep ? c : '_';
    }
    out[n] = '\0';
    if (n == 0) snprintf(out, out_size, "unnamed");
}

/* ---------------------------------------------------------------------------------------------------------------
 * The report of one pipeline: its executables' statistics as JSON lines, and optionally their text IRs.
 */

static void write_internal_representations(const DeviceRecord *dev, const VkPipelineExecutableInfoKHR *info,
                                           const char *dir, unsigned long long seq, const char *entry,
                                           const char *executable_name) {
    uint32_t count = 0;
    if (dev->get_internal_representations(dev->device, info, &count, NULL) != VK_SUCCESS || count == 0) return;
    VkPipelineExecutableInternalRepresentationKHR *irs = calloc(count, sizeof *irs);
    if (!irs) return;
    for (uint32_t i = 0; i < count; i++) irs[i].sType = VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_INTERNAL_REPRESENTATION_KHR;
    /* first the sizes (pData NULL), then the data */
    VkResult result = dev->get_internal_representations(dev->device, info, &count, irs);
    if (result == VK_SUCCESS || result == VK_INCOMPLETE) {
        for (uint32_t i = 0; i < count; i++) irs[i].pData = irs[i].dataSize ? malloc(irs[i].dataSize) : NULL;
        result = dev->get_internal_representations(dev->device, info, &count, irs);
    }
    if (result == VK_SUCCESS || result == VK_INCOMPLETE) {
        mkdir(dir, 0777); /* one level; an existing folder is fine */
        char entry_part[96], executable_part[96];
        sanitise(entry_part, sizeof entry_part, entry, 256);
        sanitise(executable_part, sizeof executable_part, executable_name, VK_MAX_DESCRIPTION_SIZE);
        for (uint32_t i = 0; i < count; i++) {
            if (!irs[i].isText || !irs[i].pData) continue; /* binary representations are skipped */
            char ir_part[96], path[4096];
            sanitise(ir_part, sizeof ir_part, irs[i].name, VK_MAX_DESCRIPTION_SIZE);
            /* two representations of one name (it happens) get the index too */
            int repeated = 0;
            for (uint32_t j = 0; j < count; j++)
                if (j != i && strncmp(irs[j].name, irs[i].name, VK_MAX_DESCRIPTION_SIZE) == 0) repeated = 1;
            if (repeated)
                snprintf(path, sizeof path, "%s/%llu_%s_%s_%s_%u.txt", dir, seq, entry_part, executable_part, ir_part, i);
            else
                snprintf(path, sizeof path, "%s/%llu_%s_%s_%s.txt", dir, seq, entry_part, executable_part, ir_part);
            FILE *f = fopen(path, "w");
            if (!f) {
                layer_message("cannot write %s: %s", path, strerror(errno));
                continue;
            }
            size_t length = strnlen(irs[i].pData, irs[i].dataSize); /* the text ends with a NUL */
            fwrite(irs[i].pData, 1, length, f);
            fclose(f);
        }
    }
    for (uint32_t i = 0; i < count; i++) free(irs[i].pData);
    free(irs);
}

/* The seq numbers of `count` new pipelines: the first of them. */
static unsigned long long reserve_seq(uint32_t count) {
    pthread_mutex_lock(&table_lock);
    unsigned long long first = pipeline_seq;
    pipeline_seq += count;
    pthread_mutex_unlock(&table_lock);
    return first;
}

static void report_pipeline(const DeviceRecord *dev, VkPipeline pipeline, const char *entry, unsigned long long seq) {
    VkPipelineInfoKHR pipeline_info = {VK_STRUCTURE_TYPE_PIPELINE_INFO_KHR, NULL, pipeline};
    uint32_t executable_count = 0;
    if (dev->get_executable_properties(dev->device, &pipeline_info, &executable_count, NULL) != VK_SUCCESS) return;
    VkPipelineExecutablePropertiesKHR *executables = calloc(executable_count ? executable_count : 1, sizeof *executables);
    if (!executables) return;
    for (uint32_t i = 0; i < executable_count; i++) executables[i].sType = VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_PROPERTIES_KHR;
    VkResult result = dev->get_executable_properties(dev->device, &pipeline_info, &executable_count, executables);
    if (result != VK_SUCCESS && result != VK_INCOMPLETE) executable_count = 0;

    const char *ir_dir = getenv("MAMBACTL_PIPELINE_IR_DIR");
    Text lines = {0};
    for (uint32_t e = 0; e < executable_count; e++) {
        const VkPipelineExecutablePropertiesKHR *exe = &executables[e];
        VkPipelineExecutableInfoKHR info = {VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_INFO_KHR, NULL, pipeline, e};
        uint32_t stat_count = 0;
        VkPipelineExecutableStatisticKHR *stats = NULL;
        if (dev->get_executable_statistics(dev->device, &info, &stat_count, NULL) == VK_SUCCESS && stat_count) {
            stats = calloc(stat_count, sizeof *stats);
            if (stats) {
                for (uint32_t i = 0; i < stat_count; i++) stats[i].sType = VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_STATISTIC_KHR;
                result = dev->get_executable_statistics(dev->device, &info, &stat_count, stats);
                if (result != VK_SUCCESS && result != VK_INCOMPLETE) stat_count = 0;
            } else {
                stat_count = 0;
            }
        } else {
            stat_count = 0;
        }

        text_printf(&lines, "{\"seq\": %llu, \"pid\": %ld, \"device\": ", seq, (long)getpid());
        text_json_string(&lines, dev->device_name, sizeof dev->device_name);
        text_printf(&lines, ", \"entry\": ");
        text_json_string(&lines, entry, 256);
        text_printf(&lines, ", \"executable\": ");
        text_json_string(&lines, exe->name, VK_MAX_DESCRIPTION_SIZE);
        text_printf(&lines, ", \"description\": ");
        text_json_string(&lines, exe->description, VK_MAX_DESCRIPTION_SIZE);
        text_printf(&lines, ", \"subgroup_size\": %u, \"stats\": {", exe->subgroupSize);
        for (uint32_t i = 0; i < stat_count; i++) {
            if (i) text_printf(&lines, ", ");
            text_json_string(&lines, stats[i].name, VK_MAX_DESCRIPTION_SIZE);
            text_printf(&lines, ": ");
            text_statistic_value(&lines, &stats[i]);
        }
        text_printf(&lines, "}, \"stat_descriptions\": {");
        for (uint32_t i = 0; i < stat_count; i++) {
            if (i) text_printf(&lines, ", ");
            text_json_string(&lines, stats[i].name, VK_MAX_DESCRIPTION_SIZE);
            text_printf(&lines, ": ");
            text_json_string(&lines, stats[i].description, VK_MAX_DESCRIPTION_SIZE);
        }
        text_printf(&lines, "}}\n");
        free(stats);

        if (ir_dir && *ir_dir && dev->get_internal_representations) {
            pthread_mutex_lock(&output_lock);
            write_internal_representations(dev, &info, ir_dir, seq, entry, exe->name);
            pthread_mutex_unlock(&output_lock);
        }
    }
    free(executables);

    if (lines.length) {
        const char *path = getenv("MAMBACTL_PIPELINE_STATS");
        pthread_mutex_lock(&output_lock);
        FILE *f = (path && *path) ? fopen(path, "a") : stderr;
        if (f) {
            fwrite(lines.data, 1, lines.length, f);
            if (f == stderr)
                fflush(f);
            else
                fclose(f);
        } else {
            layer_message("cannot append to %s: %s", path, strerror(errno));
        }
        pthread_mutex_unlock(&output_lock);
    }
    free(lines.data);
}

/* The driver's pipeline cache data of one vkCreateComputePipelines call, as DIR/<seq>_<entry>.pipeline_cache.bin:
 * where the driver offers no statistics, its binaries (in a format of its own) may still be in there. */
static void write_pipeline_cache(const DeviceRecord *dev, VkPipelineCache cache, const char *dir,
                                 unsigned long long seq, const char *entry) {
    size_t size = 0;
    if (dev->get_pipeline_cache_data(dev->device, cache, &size, NULL) != VK_SUCCESS || size == 0) return;
    void *data = malloc(size);
    if (!data) return;
    VkResult result = dev->get_pipeline_cache_data(dev->device, cache, &size, data);
    if (result == VK_SUCCESS || result == VK_INCOMPLETE) {
        char entry_part[96], path[4096];
        sanitise(entry_part, sizeof entry_part, entry, 256);
        snprintf(path, sizeof path, "%s/%llu_%s.pipeline_cache.bin", dir, seq, entry_part);
        pthread_mutex_lock(&output_lock);
        mkdir(dir, 0777);
        FILE *f = fopen(path, "wb");
        if (f) {
            fwrite(data, 1, size, f);
            fclose(f);
        } else {
            layer_message("cannot write %s: %s", path, strerror(errno));
        }
        pthread_mutex_unlock(&output_lock);
    }
    free(data);
}

/* ---------------------------------------------------------------------------------------------------------------
 * The intercepted commands.
 */

static VKAPI_ATTR VkResult VKAPI_CALL layer_CreateInstance(const VkInstanceCreateInfo *pCreateInfo,
                                                           const VkAllocationCallbacks *pAllocator,
                                                           VkInstance *pInstance) {
    VkLayerInstanceCreateInfo *chain = (VkLayerInstanceCreateInfo *)pCreateInfo->pNext;
    while (chain && !(chain->sType == VK_STRUCTURE_TYPE_LOADER_INSTANCE_CREATE_INFO && chain->function == VK_LAYER_LINK_INFO))
        chain = (VkLayerInstanceCreateInfo *)chain->pNext;
    if (!chain) return VK_ERROR_INITIALIZATION_FAILED;
    PFN_vkGetInstanceProcAddr next_gipa = chain->u.pLayerInfo->pfnNextGetInstanceProcAddr;
    chain->u.pLayerInfo = chain->u.pLayerInfo->pNext; /* the next layer finds its own link */

    PFN_vkCreateInstance next_create_instance = (PFN_vkCreateInstance)next_gipa(VK_NULL_HANDLE, "vkCreateInstance");
    if (!next_create_instance) return VK_ERROR_INITIALIZATION_FAILED;
    VkResult result = next_create_instance(pCreateInfo, pAllocator, pInstance);
    if (result != VK_SUCCESS) return result;

    InstanceRecord *r = calloc(1, sizeof *r);
    if (!r) return result; /* untracked: its devices pass through */
    r->key = dispatch_key(*pInstance);
    r->instance = *pInstance;
    uint32_t api_version = pCreateInfo->pApplicationInfo ? pCreateInfo->pApplicationInfo->apiVersion : VK_API_VERSION_1_0;
    r->has_features2 = api_version >= VK_API_VERSION_1_1;
    for (uint32_t i = 0; i < pCreateInfo->enabledExtensionCount; i++)
        if (strcmp(pCreateInfo->ppEnabledExtensionNames[i], VK_KHR_GET_PHYSICAL_DEVICE_PROPERTIES_2_EXTENSION_NAME) == 0)
            r->has_features2 = 1;
    r->next_get_instance_proc_addr = next_gipa;
    r->next_destroy_instance = (PFN_vkDestroyInstance)next_gipa(*pInstance, "vkDestroyInstance");
    r->next_enumerate_device_extensions =
        (PFN_vkEnumerateDeviceExtensionProperties)next_gipa(*pInstance, "vkEnumerateDeviceExtensionProperties");
    r->next_get_physical_device_properties =
        (PFN_vkGetPhysicalDeviceProperties)next_gipa(*pInstance, "vkGetPhysicalDeviceProperties");
    r->next_get_physical_device_features2 = (PFN_vkGetPhysicalDeviceFeatures2)next_gipa(
        *pInstance, api_version >= VK_API_VERSION_1_1 ? "vkGetPhysicalDeviceFeatures2" : "vkGetPhysicalDeviceFeatures2KHR");
    pthread_mutex_lock(&table_lock);
    r->next = instances;
    instances = r;
    pthread_mutex_unlock(&table_lock);
    return result;
}

static VKAPI_ATTR void VKAPI_CALL layer_DestroyInstance(VkInstance instance, const VkAllocationCallbacks *pAllocator) {
    if (!instance) return;
    PFN_vkDestroyInstance next_destroy = NULL;
    pthread_mutex_lock(&table_lock);
    for (InstanceRecord **link = &instances; *link; link = &(*link)->next) {
        if ((*link)->key == dispatch_key(instance)) {
            InstanceRecord *r = *link;
            next_destroy = r->next_destroy_instance;
            *link = r->next;
            free(r);
            break;
        }
    }
    pthread_mutex_unlock(&table_lock);
    if (next_destroy) next_destroy(instance, pAllocator);
}

/* Whether the physical device offers the extension and its feature (asked of the next layer down). */
static int device_offers_executable_properties(const InstanceRecord *inst, VkPhysicalDevice physical_device) {
    if (!inst->next_enumerate_device_extensions) return 0;
    uint32_t count = 0;
    if (inst->next_enumerate_device_extensions(physical_device, NULL, &count, NULL) != VK_SUCCESS) return 0;
    VkExtensionProperties *extensions = calloc(count ? count : 1, sizeof *extensions);
    if (!extensions) return 0;
    int offered = 0;
    VkResult result = inst->next_enumerate_device_extensions(physical_device, NULL, &count, extensions);
    if (result == VK_SUCCESS || result == VK_INCOMPLETE)
        for (uint32_t i = 0; i < count; i++)
            if (strcmp(extensions[i].extensionName, VK_KHR_PIPELINE_EXECUTABLE_PROPERTIES_EXTENSION_NAME) == 0) offered = 1;
    free(extensions);
    /* the extension needs vkGetPhysicalDeviceFeatures2 (Vulkan 1.1 or VK_KHR_get_physical_device_properties2) */
    if (!offered || !inst->has_features2 || !inst->next_get_physical_device_features2) return 0;
    VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR feature = {
        VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PIPELINE_EXECUTABLE_PROPERTIES_FEATURES_KHR, NULL, VK_FALSE};
    VkPhysicalDeviceFeatures2 features = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, .pNext = &feature};
    inst->next_get_physical_device_features2(physical_device, &features);
    return feature.pipelineExecutableInfo == VK_TRUE;
}

static VKAPI_ATTR VkResult VKAPI_CALL layer_CreateDevice(VkPhysicalDevice physicalDevice,
                                                         const VkDeviceCreateInfo *pCreateInfo,
                                                         const VkAllocationCallbacks *pAllocator, VkDevice *pDevice) {
    VkLayerDeviceCreateInfo *chain = (VkLayerDeviceCreateInfo *)pCreateInfo->pNext;
    while (chain && !(chain->sType == VK_STRUCTURE_TYPE_LOADER_DEVICE_CREATE_INFO && chain->function == VK_LAYER_LINK_INFO))
        chain = (VkLayerDeviceCreateInfo *)chain->pNext;
    if (!chain) return VK_ERROR_INITIALIZATION_FAILED;
    PFN_vkGetInstanceProcAddr next_gipa = chain->u.pLayerInfo->pfnNextGetInstanceProcAddr;
    PFN_vkGetDeviceProcAddr next_gdpa = chain->u.pLayerInfo->pfnNextGetDeviceProcAddr;
    chain->u.pLayerInfo = chain->u.pLayerInfo->pNext;

    InstanceRecord inst;
    int known_instance = lookup_instance(dispatch_key(physicalDevice), &inst);
    PFN_vkCreateDevice next_create_device =
        (PFN_vkCreateDevice)next_gipa(known_instance ? inst.instance : VK_NULL_HANDLE, "vkCreateDevice");
    if (!next_create_device) return VK_ERROR_INITIALIZATION_FAILED;

    char device_name[VK_MAX_PHYSICAL_DEVICE_NAME_SIZE] = "unknown device";
    if (known_instance && inst.next_get_physical_device_properties) {
        VkPhysicalDeviceProperties properties;
        inst.next_get_physical_device_properties(physicalDevice, &properties);
        memcpy(device_name, properties.deviceName, sizeof device_name);
        device_name[sizeof device_name - 1] = '\0';
    }
    int offered = known_instance && device_offers_executable_properties(&inst, physicalDevice);
    if (!offered)
        layer_message("%s does not offer VK_KHR_pipeline_executable_properties (or its pipelineExecutableInfo "
                      "feature): no pipeline statistics from this device", device_name);

    /* The app's create info with the extension and the feature added where it did not ask for them. */
    VkDeviceCreateInfo create_info = *pCreateInfo;
    const char **extension_names = NULL;
    VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR *app_feature = NULL;
    VkBool32 app_feature_value = VK_FALSE;
    VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR added_feature = {
        VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PIPELINE_EXECUTABLE_PROPERTIES_FEATURES_KHR, NULL, VK_TRUE};
    if (offered) {
        int enabled = 0;
        for (uint32_t i = 0; i < pCreateInfo->enabledExtensionCount; i++)
            if (strcmp(pCreateInfo->ppEnabledExtensionNames[i], VK_KHR_PIPELINE_EXECUTABLE_PROPERTIES_EXTENSION_NAME) == 0)
                enabled = 1;
        if (!enabled) {
            extension_names = malloc((pCreateInfo->enabledExtensionCount + 1) * sizeof *extension_names);
            if (!extension_names) return VK_ERROR_OUT_OF_HOST_MEMORY;
            for (uint32_t i = 0; i < pCreateInfo->enabledExtensionCount; i++)
                extension_names[i] = pCreateInfo->ppEnabledExtensionNames[i];
            extension_names[pCreateInfo->enabledExtensionCount] = VK_KHR_PIPELINE_EXECUTABLE_PROPERTIES_EXTENSION_NAME;
            create_info.enabledExtensionCount = pCreateInfo->enabledExtensionCount + 1;
            create_info.ppEnabledExtensionNames = extension_names;
        }
        /* A second copy of the feature struct in the chain would be invalid: where the app has one, set it (for
         * the driver's call only: it is restored below). */
        for (VkBaseOutStructure *s = (VkBaseOutStructure *)pCreateInfo->pNext; s; s = s->pNext)
            if (s->sType == VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PIPELINE_EXECUTABLE_PROPERTIES_FEATURES_KHR)
                app_feature = (VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR *)s;
        if (app_feature) {
            app_feature_value = app_feature->pipelineExecutableInfo;
            app_feature->pipelineExecutableInfo = VK_TRUE;
        } else {
            added_feature.pNext = (void *)pCreateInfo->pNext; /* ahead of the app's chain (and the loader's link) */
            create_info.pNext = &added_feature;
        }
    }

    VkResult result = next_create_device(physicalDevice, &create_info, pAllocator, pDevice);
    free(extension_names);
    if (app_feature) app_feature->pipelineExecutableInfo = app_feature_value;
    if (result != VK_SUCCESS && offered) {
        layer_message("%s refused the device with VK_KHR_pipeline_executable_properties enabled (VkResult %d): "
                      "creating it as the app asked, without statistics", device_name, (int)result);
        offered = 0;
        result = next_create_device(physicalDevice, pCreateInfo, pAllocator, pDevice);
    }
    if (result != VK_SUCCESS) return result;

    DeviceRecord *r = calloc(1, sizeof *r);
    if (!r) return result;
    r->key = dispatch_key(*pDevice);
    r->device = *pDevice;
    memcpy(r->device_name, device_name, sizeof r->device_name);
    r->next_get_device_proc_addr = next_gdpa;
    r->next_destroy_device = (PFN_vkDestroyDevice)next_gdpa(*pDevice, "vkDestroyDevice");
    r->next_create_compute_pipelines = (PFN_vkCreateComputePipelines)next_gdpa(*pDevice, "vkCreateComputePipelines");
    r->create_pipeline_cache = (PFN_vkCreatePipelineCache)next_gdpa(*pDevice, "vkCreatePipelineCache");
    r->get_pipeline_cache_data = (PFN_vkGetPipelineCacheData)next_gdpa(*pDevice, "vkGetPipelineCacheData");
    r->destroy_pipeline_cache = (PFN_vkDestroyPipelineCache)next_gdpa(*pDevice, "vkDestroyPipelineCache");
    if (offered) {
        r->get_executable_properties =
            (PFN_vkGetPipelineExecutablePropertiesKHR)next_gdpa(*pDevice, "vkGetPipelineExecutablePropertiesKHR");
        r->get_executable_statistics =
            (PFN_vkGetPipelineExecutableStatisticsKHR)next_gdpa(*pDevice, "vkGetPipelineExecutableStatisticsKHR");
        r->get_internal_representations = (PFN_vkGetPipelineExecutableInternalRepresentationsKHR)next_gdpa(
            *pDevice, "vkGetPipelineExecutableInternalRepresentationsKHR");
        if (!r->get_executable_properties || !r->get_executable_statistics) {
            layer_message("%s: the driver gave no vkGetPipelineExecutable*KHR entry points: no statistics", device_name);
            r->get_executable_properties = NULL;
        }
    }
    pthread_mutex_lock(&table_lock);
    r->next = devices;
    devices = r;
    pthread_mutex_unlock(&table_lock);
    return result;
}

static VKAPI_ATTR void VKAPI_CALL layer_DestroyDevice(VkDevice device, const VkAllocationCallbacks *pAllocator) {
    if (!device) return;
    PFN_vkDestroyDevice next_destroy = NULL;
    pthread_mutex_lock(&table_lock);
    for (DeviceRecord **link = &devices; *link; link = &(*link)->next) {
        if ((*link)->key == dispatch_key(device)) {
            DeviceRecord *r = *link;
            next_destroy = r->next_destroy_device;
            *link = r->next;
            free(r);
            break;
        }
    }
    pthread_mutex_unlock(&table_lock);
    if (next_destroy) next_destroy(device, pAllocator);
}

static VKAPI_ATTR VkResult VKAPI_CALL layer_CreateComputePipelines(VkDevice device, VkPipelineCache pipelineCache,
                                                                   uint32_t createInfoCount,
                                                                   const VkComputePipelineCreateInfo *pCreateInfos,
                                                                   const VkAllocationCallbacks *pAllocator,
                                                                   VkPipeline *pPipelines) {
    DeviceRecord dev;
    if (!lookup_device(dispatch_key(device), &dev) || !dev.next_create_compute_pipelines)
        return VK_ERROR_INITIALIZATION_FAILED; /* a device this layer never saw created */
    int statistics = dev.get_executable_properties != NULL;
    /* The cache dump needs a cache of its own: only where the app passes none (wgpu does not). */
    const char *cache_dir = getenv("MAMBACTL_PIPELINE_CACHE_DIR");
    VkPipelineCache own_cache = VK_NULL_HANDLE;
    if (cache_dir && *cache_dir && pipelineCache == VK_NULL_HANDLE && dev.create_pipeline_cache &&
        dev.get_pipeline_cache_data && dev.destroy_pipeline_cache && createInfoCount) {
        VkPipelineCacheCreateInfo cache_info = {VK_STRUCTURE_TYPE_PIPELINE_CACHE_CREATE_INFO, NULL, 0, 0, NULL};
        if (dev.create_pipeline_cache(device, &cache_info, NULL, &own_cache) != VK_SUCCESS) own_cache = VK_NULL_HANDLE;
    }
    if ((!statistics && !own_cache) || createInfoCount == 0)
        return dev.next_create_compute_pipelines(device, pipelineCache, createInfoCount, pCreateInfos, pAllocator, pPipelines);

    /* The app's create infos with the capture flags added. (A VkPipelineCreateFlags2CreateInfoKHR in pNext,
     * VK_KHR_maintenance5, would override these flags; wgpu passes none.) */
    const char *ir_dir = getenv("MAMBACTL_PIPELINE_IR_DIR");
    VkPipelineCreateFlags capture = 0;
    if (statistics) capture |= VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR;
    if (statistics && ir_dir && *ir_dir && dev.get_internal_representations)
        capture |= VK_PIPELINE_CREATE_CAPTURE_INTERNAL_REPRESENTATIONS_BIT_KHR;
    VkComputePipelineCreateInfo *create_infos = malloc(createInfoCount * sizeof *create_infos);
    if (!create_infos) {
        if (own_cache) dev.destroy_pipeline_cache(device, own_cache, NULL);
        return VK_ERROR_OUT_OF_HOST_MEMORY;
    }
    for (uint32_t i = 0; i < createInfoCount; i++) {
        create_infos[i] = pCreateInfos[i];
        create_infos[i].flags |= capture;
    }
    VkResult result = dev.next_create_compute_pipelines(device, own_cache ? own_cache : pipelineCache, createInfoCount,
                                                        create_infos, pAllocator, pPipelines);
    unsigned long long first_seq = reserve_seq(createInfoCount);
    /* even a failed batch may hold some pipelines (the others VK_NULL_HANDLE) */
    for (uint32_t i = 0; statistics && i < createInfoCount; i++)
        if (pPipelines[i] != VK_NULL_HANDLE)
            report_pipeline(&dev, pPipelines[i], create_infos[i].stage.pName ? create_infos[i].stage.pName : "",
                            first_seq + i);
    if (own_cache) {
        write_pipeline_cache(&dev, own_cache, cache_dir, first_seq,
                             create_infos[0].stage.pName ? create_infos[0].stage.pName : "");
        dev.destroy_pipeline_cache(device, own_cache, NULL);
    }
    free(create_infos);
    return result;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Lookup and the loader interface. The exported vkGetInstanceProcAddr / vkGetDeviceProcAddr only forward to the
 * static ones, and only the static ones' addresses are handed out: the address of an exported symbol could
 * resolve to the loader's function of the same name (symbol interposition).
 */

static VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL layer_GetDeviceProcAddr(VkDevice device, const char *pName);

static PFN_vkVoidFunction intercepted_device_command(const char *name) {
    if (strcmp(name, "vkGetDeviceProcAddr") == 0) return (PFN_vkVoidFunction)layer_GetDeviceProcAddr;
    if (strcmp(name, "vkDestroyDevice") == 0) return (PFN_vkVoidFunction)layer_DestroyDevice;
    if (strcmp(name, "vkCreateComputePipelines") == 0) return (PFN_vkVoidFunction)layer_CreateComputePipelines;
    return NULL;
}

static VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL layer_GetInstanceProcAddr(VkInstance instance, const char *pName) {
    if (strcmp(pName, "vkGetInstanceProcAddr") == 0) return (PFN_vkVoidFunction)layer_GetInstanceProcAddr;
    if (strcmp(pName, "vkCreateInstance") == 0) return (PFN_vkVoidFunction)layer_CreateInstance;
    if (strcmp(pName, "vkDestroyInstance") == 0) return (PFN_vkVoidFunction)layer_DestroyInstance;
    if (strcmp(pName, "vkCreateDevice") == 0) return (PFN_vkVoidFunction)layer_CreateDevice;
    PFN_vkVoidFunction own = intercepted_device_command(pName);
    if (own) return own;
    if (!instance) return NULL;
    InstanceRecord inst;
    if (!lookup_instance(dispatch_key(instance), &inst)) return NULL;
    return inst.next_get_instance_proc_addr(instance, pName);
}

static VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL layer_GetDeviceProcAddr(VkDevice device, const char *pName) {
    PFN_vkVoidFunction own = intercepted_device_command(pName);
    if (own) return own;
    if (!device) return NULL;
    DeviceRecord dev;
    if (!lookup_device(dispatch_key(device), &dev)) return NULL;
    return dev.next_get_device_proc_addr(device, pName);
}

EXPORT VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL vkGetInstanceProcAddr(VkInstance instance, const char *pName) {
    return layer_GetInstanceProcAddr(instance, pName);
}

EXPORT VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL vkGetDeviceProcAddr(VkDevice device, const char *pName) {
    return layer_GetDeviceProcAddr(device, pName);
}

EXPORT VKAPI_ATTR VkResult VKAPI_CALL vkNegotiateLoaderLayerInterfaceVersion(VkNegotiateLayerInterface *pVersionStruct) {
    if (!pVersionStruct || pVersionStruct->sType != LAYER_NEGOTIATE_INTERFACE_STRUCT ||
        pVersionStruct->loaderLayerInterfaceVersion < 2)
        return VK_ERROR_INITIALIZATION_FAILED;
    pVersionStruct->loaderLayerInterfaceVersion = 2;
    pVersionStruct->pfnGetInstanceProcAddr = layer_GetInstanceProcAddr;
    pVersionStruct->pfnGetDeviceProcAddr = layer_GetDeviceProcAddr;
    pVersionStruct->pfnGetPhysicalDeviceProcAddr = NULL;
    return VK_SUCCESS;
}
