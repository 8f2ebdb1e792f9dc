/*
 * VK_LAYER_MAMBACTL_fake_driver: a test double for checking the stats layer (stats_layer.c) on a driver without
 * VK_KHR_pipeline_executable_properties (Mesa's lavapipe, up to 25.0 at least). Not for measurements.
 *
 * Placed below the stats layer, it pretends that the driver offers the extension: it adds the extension to
 * vkEnumerateDeviceExtensionProperties, reports pipelineExecutableInfo in vkGetPhysicalDeviceFeatures2, removes
 * both from vkCreateDevice before the driver sees them, strips the capture flags from vkCreateComputePipelines,
 * and answers the three vkGetPipelineExecutable*KHR commands with made-up values: one executable per pipeline,
 * statistics of all four formats (whether the capture flags arrived, the entry point name's length, a name that
 * needs JSON escaping) and two internal representations, a text one and a binary one.
 *
 *   ./build.sh fake
 *   VK_LAYER_PATH=bench/pipeline_stats \
 *   VK_INSTANCE_LAYERS=VK_LAYER_MAMBACTL_pipeline_stats:VK_LAYER_MAMBACTL_fake_driver \
 *   MAMBACTL_PIPELINE_STATS=/tmp/stats.jsonl python bench/gemm.py --shapes 256x256x256 --repeats 1
 *
 * (the first layer named is the one nearest the application).
 */

#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vulkan/vk_layer.h>
#include <vulkan/vulkan.h>

#define EXPORT __attribute__((visibility("default")))
#define CAPTURE_FLAGS \
    (VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR | VK_PIPELINE_CREATE_CAPTURE_INTERNAL_REPRESENTATIONS_BIT_KHR)

static void *dispatch_key(const void *handle) { return *(void **)handle; }

typedef struct Record { /* an instance, a device or a pipeline */
    struct Record *next;
    void *key; /* dispatch key (instance, device) or the pipeline handle */
    PFN_vkGetInstanceProcAddr next_gipa;
    PFN_vkGetDeviceProcAddr next_gdpa;
    VkInstance instance;
    /* an instance's next commands, fetched while vkCreateInstance runs (the loader's answers differ later) */
    PFN_vkEnumerateDeviceExtensionProperties next_enumerate_device_extensions;
    PFN_vkGetPhysicalDeviceFeatures2 next_get_features2, next_get_features2_khr;
    PFN_vkCreateDevice next_create_device;
    PFN_vkDestroyInstance next_destroy_instance;
    VkPipelineCreateFlags flags; /* a pipeline's flags as the layer above asked */
    char entry[128];             /* a pipeline's entry point */
} Record;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static Record *instances, *devices, *pipelines;

static void add(Record **list, Record *r) {
    pthread_mutex_lock(&lock);
    r->next = *list;
    *list = r;
    pthread_mutex_unlock(&lock);
}

static int find(Record **list, void *key, Record *out, int remove) {
    pthread_mutex_lock(&lock);
    for (Record **link = list; *link; link = &(*link)->next) {
        if ((*link)->key != key) continue;
        Record *r = *link;
        if (out) *out = *r;
        if (remove) {
            *link = r->next;
            free(r);
        }
        pthread_mutex_unlock(&lock);
        return 1;
    }
    pthread_mutex_unlock(&lock);
    return 0;
}

static Record instance_of(const void *handle) {
    Record inst = {0};
    find(&instances, dispatch_key(handle), &inst, 0);
    return inst;
}

static PFN_vkVoidFunction next_device_command(VkDevice device, const char *name) {
    Record dev;
    return find(&devices, dispatch_key(device), &dev, 0) ? dev.next_gdpa(device, name) : NULL;
}

/* --- instance level ----------------------------------------------------------------------------------------- */

static VKAPI_ATTR VkResult VKAPI_CALL fake_CreateInstance(const VkInstanceCreateInfo *info,
                                                          const VkAllocationCallbacks *allocator, VkInstance *instance) {
    VkLayerInstanceCreateInfo *chain = (VkLayerInstanceCreateInfo *)info->pNext;
    while (chain && !(chain->sType == VK_STRUCTURE_TYPE_LOADER_INSTANCE_CREATE_INFO && chain->function == VK_LAYER_LINK_INFO))
        chain = (VkLayerInstanceCreateInfo *)chain->pNext;
    if (!chain) return VK_ERROR_INITIALIZATION_FAILED;
    PFN_vkGetInstanceProcAddr next_gipa = chain->u.pLayerInfo->pfnNextGetInstanceProcAddr;
    chain->u.pLayerInfo = chain->u.pLayerInfo->pNext;
    VkResult result = ((PFN_vkCreateInstance)next_gipa(VK_NULL_HANDLE, "vkCreateInstance"))(info, allocator, instance);
    if (result != VK_SUCCESS) return result;
    Record *r = calloc(1, sizeof *r);
    r->key = dispatch_key(*instance);
    r->instance = *instance;
    r->next_gipa = next_gipa;
    r->next_enumerate_device_extensions =
        (PFN_vkEnumerateDeviceExtensionProperties)next_gipa(*instance, "vkEnumerateDeviceExtensionProperties");
    r->next_get_features2 = (PFN_vkGetPhysicalDeviceFeatures2)next_gipa(*instance, "vkGetPhysicalDeviceFeatures2");
    r->next_get_features2_khr = (PFN_vkGetPhysicalDeviceFeatures2)next_gipa(*instance, "vkGetPhysicalDeviceFeatures2KHR");
    r->next_create_device = (PFN_vkCreateDevice)next_gipa(*instance, "vkCreateDevice");
    r->next_destroy_instance = (PFN_vkDestroyInstance)next_gipa(*instance, "vkDestroyInstance");
    add(&instances, r);
    return result;
}

static VKAPI_ATTR void VKAPI_CALL fake_DestroyInstance(VkInstance instance, const VkAllocationCallbacks *allocator) {
    Record inst;
    if (!instance || !find(&instances, dispatch_key(instance), &inst, 1)) return;
    inst.next_destroy_instance(instance, allocator);
}

static VKAPI_ATTR VkResult VKAPI_CALL fake_EnumerateDeviceExtensionProperties(VkPhysicalDevice physical_device,
                                                                              const char *layer_name, uint32_t *count,
                                                                              VkExtensionProperties *properties) {
    PFN_vkEnumerateDeviceExtensionProperties next = instance_of(physical_device).next_enumerate_device_extensions;
    if (layer_name) return next(physical_device, layer_name, count, properties);
    uint32_t driver_count = 0;
    VkResult result = next(physical_device, NULL, &driver_count, NULL);
    if (result != VK_SUCCESS) return result;
    VkExtensionProperties *all = calloc(driver_count + 1, sizeof *all);
    next(physical_device, NULL, &driver_count, all);
    int present = 0;
    for (uint32_t i = 0; i < driver_count; i++)
        if (strcmp(all[i].extensionName, VK_KHR_PIPELINE_EXECUTABLE_PROPERTIES_EXTENSION_NAME) == 0) present = 1;
    if (!present) {
        snprintf(all[driver_count].extensionName, VK_MAX_EXTENSION_NAME_SIZE, "%s",
                 VK_KHR_PIPELINE_EXECUTABLE_PROPERTIES_EXTENSION_NAME);
        all[driver_count++].specVersion = VK_KHR_PIPELINE_EXECUTABLE_PROPERTIES_SPEC_VERSION;
    }
    if (!properties) {
        *count = driver_count;
        free(all);
        return VK_SUCCESS;
    }
    uint32_t n = *count < driver_count ? *count : driver_count;
    memcpy(properties, all, n * sizeof *all);
    *count = n;
    free(all);
    return n < driver_count ? VK_INCOMPLETE : VK_SUCCESS;
}

static void claim_feature(VkPhysicalDeviceFeatures2 *features) {
    for (VkBaseOutStructure *s = (VkBaseOutStructure *)features->pNext; s; s = s->pNext)
        if (s->sType == VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PIPELINE_EXECUTABLE_PROPERTIES_FEATURES_KHR)
            ((VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR *)s)->pipelineExecutableInfo = VK_TRUE;
}

static VKAPI_ATTR void VKAPI_CALL fake_GetPhysicalDeviceFeatures2(VkPhysicalDevice physical_device,
                                                                  VkPhysicalDeviceFeatures2 *features) {
    instance_of(physical_device).next_get_features2(physical_device, features);
    claim_feature(features);
}

static VKAPI_ATTR void VKAPI_CALL fake_GetPhysicalDeviceFeatures2KHR(VkPhysicalDevice physical_device,
                                                                     VkPhysicalDeviceFeatures2 *features) {
    instance_of(physical_device).next_get_features2_khr(physical_device, features);
    claim_feature(features);
}

static VKAPI_ATTR VkResult VKAPI_CALL fake_CreateDevice(VkPhysicalDevice physical_device, const VkDeviceCreateInfo *info,
                                                        const VkAllocationCallbacks *allocator, VkDevice *device) {
    VkLayerDeviceCreateInfo *chain = (VkLayerDeviceCreateInfo *)info->pNext;
    while (chain && !(chain->sType == VK_STRUCTURE_TYPE_LOADER_DEVICE_CREATE_INFO && chain->function == VK_LAYER_LINK_INFO))
        chain = (VkLayerDeviceCreateInfo *)chain->pNext;
    if (!chain) return VK_ERROR_INITIALIZATION_FAILED;
    PFN_vkGetDeviceProcAddr next_gdpa = chain->u.pLayerInfo->pfnNextGetDeviceProcAddr;
    chain->u.pLayerInfo = chain->u.pLayerInfo->pNext;
    Record inst = instance_of(physical_device);
    if (!inst.next_create_device) return VK_ERROR_INITIALIZATION_FAILED;

    /* the driver must see neither the extension nor the feature (it would refuse both) */
    VkDeviceCreateInfo stripped = *info;
    const char **names = calloc(info->enabledExtensionCount + 1, sizeof *names);
    stripped.enabledExtensionCount = 0;
    for (uint32_t i = 0; i < info->enabledExtensionCount; i++)
        if (strcmp(info->ppEnabledExtensionNames[i], VK_KHR_PIPELINE_EXECUTABLE_PROPERTIES_EXTENSION_NAME) != 0)
            names[stripped.enabledExtensionCount++] = info->ppEnabledExtensionNames[i];
    stripped.ppEnabledExtensionNames = names;
    VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR *feature = NULL;
    for (VkBaseOutStructure *s = (VkBaseOutStructure *)info->pNext; s; s = s->pNext)
        if (s->sType == VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PIPELINE_EXECUTABLE_PROPERTIES_FEATURES_KHR)
            feature = (VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR *)s;
    VkBool32 asked = feature ? feature->pipelineExecutableInfo : VK_FALSE;
    if (feature) feature->pipelineExecutableInfo = VK_FALSE; /* a feature not asked for is valid anywhere */
    fprintf(stderr, "VK_LAYER_MAMBACTL_fake_driver: device created with the extension %s, pipelineExecutableInfo %s\n",
            stripped.enabledExtensionCount < info->enabledExtensionCount ? "enabled" : "NOT enabled",
            asked ? "on" : "NOT on");

    VkResult result = inst.next_create_device(physical_device, &stripped, allocator, device);
    if (feature) feature->pipelineExecutableInfo = asked;
    free(names);
    if (result != VK_SUCCESS) return result;
    Record *r = calloc(1, sizeof *r);
    r->key = dispatch_key(*device);
    r->next_gdpa = next_gdpa;
    add(&devices, r);
    return result;
}

/* --- device level ------------------------------------------------------------------------------------------- */

static VKAPI_ATTR void VKAPI_CALL fake_DestroyDevice(VkDevice device, const VkAllocationCallbacks *allocator) {
    Record dev;
    if (!device || !find(&devices, dispatch_key(device), &dev, 1)) return;
    ((PFN_vkDestroyDevice)dev.next_gdpa(device, "vkDestroyDevice"))(device, allocator);
}

static VKAPI_ATTR VkResult VKAPI_CALL fake_CreateComputePipelines(VkDevice device, VkPipelineCache cache, uint32_t count,
                                                                  const VkComputePipelineCreateInfo *infos,
                                                                  const VkAllocationCallbacks *allocator,
                                                                  VkPipeline *pipelines_out) {
    VkComputePipelineCreateInfo *stripped = calloc(count ? count : 1, sizeof *stripped);
    for (uint32_t i = 0; i < count; i++) {
        stripped[i] = infos[i];
        stripped[i].flags &= ~(VkPipelineCreateFlags)CAPTURE_FLAGS;
    }
    VkResult result = ((PFN_vkCreateComputePipelines)next_device_command(device, "vkCreateComputePipelines"))(
        device, cache, count, stripped, allocator, pipelines_out);
    free(stripped);
    for (uint32_t i = 0; i < count; i++) {
        if (pipelines_out[i] == VK_NULL_HANDLE) continue;
        Record *r = calloc(1, sizeof *r);
        r->key = (void *)pipelines_out[i];
        r->flags = infos[i].flags;
        snprintf(r->entry, sizeof r->entry, "%s", infos[i].stage.pName ? infos[i].stage.pName : "");
        add(&pipelines, r);
    }
    return result;
}

static VKAPI_ATTR void VKAPI_CALL fake_DestroyPipeline(VkDevice device, VkPipeline pipeline,
                                                       const VkAllocationCallbacks *allocator) {
    if (pipeline) find(&pipelines, (void *)pipeline, NULL, 1);
    ((PFN_vkDestroyPipeline)next_device_command(device, "vkDestroyPipeline"))(device, pipeline, allocator);
}

/* The two-call idiom of the vkGetPipelineExecutable*KHR commands over `available` items. */
static VkResult fill_count(uint32_t *count, int have_array, uint32_t available, uint32_t *written) {
    if (!have_array) {
        *count = available;
        *written = 0;
        return VK_SUCCESS;
    }
    *written = *count < available ? *count : available;
    *count = *written;
    return *written < available ? VK_INCOMPLETE : VK_SUCCESS;
}

static VKAPI_ATTR VkResult VKAPI_CALL fake_GetPipelineExecutablePropertiesKHR(VkDevice device, const VkPipelineInfoKHR *info,
                                                                              uint32_t *count,
                                                                              VkPipelineExecutablePropertiesKHR *properties) {
    (void)device;
    Record pipe;
    if (!find(&pipelines, (void *)info->pipeline, &pipe, 0)) return VK_ERROR_UNKNOWN;
    uint32_t written;
    VkResult result = fill_count(count, properties != NULL, 1, &written);
    if (written) {
        properties[0].stages = VK_SHADER_STAGE_COMPUTE_BIT;
        snprintf(properties[0].name, VK_MAX_DESCRIPTION_SIZE, "Compute Shader");
        snprintf(properties[0].description, VK_MAX_DESCRIPTION_SIZE, "fake executable of %s (VK_LAYER_MAMBACTL_fake_driver)",
                 pipe.entry);
        properties[0].subgroupSize = 8;
    }
    return result;
}

static VKAPI_ATTR VkResult VKAPI_CALL fake_GetPipelineExecutableStatisticsKHR(VkDevice device,
                                                                              const VkPipelineExecutableInfoKHR *info,
                                                                              uint32_t *count,
                                                                              VkPipelineExecutableStatisticKHR *stats) {
    (void)device;
    Record pipe;
    if (!find(&pipelines, (void *)info->pipeline, &pipe, 0) || info->executableIndex != 0) return VK_ERROR_UNKNOWN;
    VkPipelineExecutableStatisticKHR all[6] = {{0}};
    snprintf(all[0].name, VK_MAX_DESCRIPTION_SIZE, "Capture statistics flag");
    all[0].format = VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_BOOL32_KHR;
    all[0].value.b32 = (pipe.flags & VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR) != 0;
    snprintf(all[1].name, VK_MAX_DESCRIPTION_SIZE, "Capture IR flag");
    all[1].format = VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_BOOL32_KHR;
    all[1].value.b32 = (pipe.flags & VK_PIPELINE_CREATE_CAPTURE_INTERNAL_REPRESENTATIONS_BIT_KHR) != 0;
    snprintf(all[2].name, VK_MAX_DESCRIPTION_SIZE, "Entry name length");
    all[2].format = VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR;
    all[2].value.u64 = strlen(pipe.entry);
    snprintf(all[3].name, VK_MAX_DESCRIPTION_SIZE, "Signed");
    all[3].format = VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_INT64_KHR;
    all[3].value.i64 = -7;
    snprintf(all[4].name, VK_MAX_DESCRIPTION_SIZE, "Ratio");
    all[4].format = VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_FLOAT64_KHR;
    all[4].value.f64 = 0.25;
    snprintf(all[5].name, VK_MAX_DESCRIPTION_SIZE, "Quote \" backslash \\ tab \t end");
    all[5].format = VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR;
    all[5].value.u64 = 1;
    for (int i = 0; i < 6; i++) snprintf(all[i].description, VK_MAX_DESCRIPTION_SIZE, "fake statistic %d", i);
    uint32_t written;
    VkResult result = fill_count(count, stats != NULL, 6, &written);
    for (uint32_t i = 0; i < written; i++) {
        void *next = stats[i].pNext;
        stats[i] = all[i];
        stats[i].sType = VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_STATISTIC_KHR;
        stats[i].pNext = next;
    }
    return result;
}

static VKAPI_ATTR VkResult VKAPI_CALL fake_GetPipelineExecutableInternalRepresentationsKHR(
    VkDevice device, const VkPipelineExecutableInfoKHR *info, uint32_t *count,
    VkPipelineExecutableInternalRepresentationKHR *irs) {
    (void)device;
    Record pipe;
    if (!find(&pipelines, (void *)info->pipeline, &pipe, 0) || info->executableIndex != 0) return VK_ERROR_UNKNOWN;
    char text[256];
    snprintf(text, sizeof text, "fake NIR of %s\n  \"quoted\" line\n", pipe.entry);
    static const unsigned char binary[4] = {0xde, 0xad, 0xbe, 0xef};
    const void *data[2] = {text, binary};
    size_t sizes[2] = {strlen(text) + 1, sizeof binary};
    uint32_t written;
    VkResult result = fill_count(count, irs != NULL, 2, &written);
    for (uint32_t i = 0; i < written; i++) {
        snprintf(irs[i].name, VK_MAX_DESCRIPTION_SIZE, i == 0 ? "Fake NIR (final)" : "Fake binary");
        snprintf(irs[i].description, VK_MAX_DESCRIPTION_SIZE, "fake representation %u", i);
        irs[i].isText = i == 0;
        if (!irs[i].pData) {
            irs[i].dataSize = sizes[i];
            continue;
        }
        size_t n = irs[i].dataSize < sizes[i] ? irs[i].dataSize : sizes[i];
        memcpy(irs[i].pData, data[i], n);
        if (n < sizes[i]) result = VK_INCOMPLETE;
        irs[i].dataSize = n;
    }
    return result;
}

/* --- lookup and the loader interface ------------------------------------------------------------------------ */

static VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL fake_GetDeviceProcAddr(VkDevice device, const char *name);

static PFN_vkVoidFunction own_device_command(const char *name) {
    static const struct { const char *name; PFN_vkVoidFunction function; } commands[] = {
        {"vkGetDeviceProcAddr", (PFN_vkVoidFunction)fake_GetDeviceProcAddr},
        {"vkDestroyDevice", (PFN_vkVoidFunction)fake_DestroyDevice},
        {"vkCreateComputePipelines", (PFN_vkVoidFunction)fake_CreateComputePipelines},
        {"vkDestroyPipeline", (PFN_vkVoidFunction)fake_DestroyPipeline},
        {"vkGetPipelineExecutablePropertiesKHR", (PFN_vkVoidFunction)fake_GetPipelineExecutablePropertiesKHR},
        {"vkGetPipelineExecutableStatisticsKHR", (PFN_vkVoidFunction)fake_GetPipelineExecutableStatisticsKHR},
        {"vkGetPipelineExecutableInternalRepresentationsKHR",
         (PFN_vkVoidFunction)fake_GetPipelineExecutableInternalRepresentationsKHR},
    };
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (strcmp(name, commands[i].name) == 0) return commands[i].function;
    return NULL;
}

static VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL fake_GetInstanceProcAddr(VkInstance instance, const char *name) {
    static const struct { const char *name; PFN_vkVoidFunction function; } commands[] = {
        {"vkGetInstanceProcAddr", (PFN_vkVoidFunction)fake_GetInstanceProcAddr},
        {"vkCreateInstance", (PFN_vkVoidFunction)fake_CreateInstance},
        {"vkDestroyInstance", (PFN_vkVoidFunction)fake_DestroyInstance},
        {"vkCreateDevice", (PFN_vkVoidFunction)fake_CreateDevice},
        {"vkEnumerateDeviceExtensionProperties", (PFN_vkVoidFunction)fake_EnumerateDeviceExtensionProperties},
        {"vkGetPhysicalDeviceFeatures2", (PFN_vkVoidFunction)fake_GetPhysicalDeviceFeatures2},
        {"vkGetPhysicalDeviceFeatures2KHR", (PFN_vkVoidFunction)fake_GetPhysicalDeviceFeatures2KHR},
    };
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (strcmp(name, commands[i].name) == 0) return commands[i].function;
    PFN_vkVoidFunction own = own_device_command(name);
    if (own) return own;
    Record inst;
    if (!instance || !find(&instances, dispatch_key(instance), &inst, 0)) return NULL;
    return inst.next_gipa(instance, name);
}

static VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL fake_GetDeviceProcAddr(VkDevice device, const char *name) {
    PFN_vkVoidFunction own = own_device_command(name);
    if (own) return own;
    return device ? next_device_command(device, name) : NULL;
}

EXPORT VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL vkGetInstanceProcAddr(VkInstance instance, const char *name) {
    return fake_GetInstanceProcAddr(instance, name);
}

EXPORT VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL vkGetDeviceProcAddr(VkDevice device, const char *name) {
    return fake_GetDeviceProcAddr(device, name);
}

EXPORT VKAPI_ATTR VkResult VKAPI_CALL vkNegotiateLoaderLayerInterfaceVersion(VkNegotiateLayerInterface *version) {
    if (!version || version->loaderLayerInterfaceVersion < 2) return VK_ERROR_INITIALIZATION_FAILED;
    version->loaderLayerInterfaceVersion = 2;
    version->pfnGetInstanceProcAddr = fake_GetInstanceProcAddr;
    version->pfnGetDeviceProcAddr = fake_GetDeviceProcAddr;
    version->pfnGetPhysicalDeviceProcAddr = NULL;
    return VK_SUCCESS;
}
